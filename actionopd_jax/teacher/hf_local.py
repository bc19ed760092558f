"""`teacher.kind: local` for the ActionOPD collector: a Qwen3 HF checkpoint directory loaded
in-process and sampled with our own Sampler, wrapped in `LocalTeacher` (the regeneration rule,
usage) and cached like any teacher -- its weights never change during the run, so its samples
are a property of the state.

The teacher renders prompts with its own tokenizer (the directory's, else the student's) and
sees exactly what the student sees: same messages, same tool schemas, no privileged text.
PRNG keys come from (seed, the prompt, how often this prompt was asked), never from the order
in which asynchronous requests arrive, so a rerun asks the same questions with the same keys.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from actionopd_jax.config import ConfigError, TeacherConfig
from actionopd_jax.types import Action, ChatMessage, Invalid, ToolSchema

LOCAL_TEACHER_PURPOSE = 33  # fold_in constant: independent of the student's and the self-teacher's keys


class HFLocalGenerator:
    """`generate(messages, tools, n) -> n reply texts` over an in-process model."""

    def __init__(self, model: Any, model_config: Any, tokenizer: Any, *, mesh: Any, seed: int,
                 max_prompt_tokens: int, max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 enable_thinking: bool, buckets: Any = None):
        from flax import nnx

        from actionopd_jax.chat.prompt import CandidateDecoder, PromptBuilder
        from actionopd_jax.sampling.batching import MicroBatcher
        from actionopd_jax.sampling.sampler import Sampler

        eos = [int(tokenizer.convert_tokens_to_ids("<|im_end|>"))]
        self.sampler = Sampler(None, model_config, eos_ids=eos, buckets=buckets)
        self.sampler.load_policy(*nnx.split(model), mesh)
        self.prompts = PromptBuilder(tokenizer, max_prompt_tokens=max_prompt_tokens, enable_thinking=enable_thinking)
        self.decoder = CandidateDecoder(tokenizer, eos_ids=eos)
        self.batcher = MicroBatcher(self._sample_batch, window_s=0.005, max_items=64)
        self.seed = int(seed)
        self.decoding = {"temperature": temperature, "top_p": top_p, "top_k": top_k,
                         "max_new_tokens": max_new_tokens, "enable_thinking": enable_thinking}
        self._asked: dict[str, int] = {}
        self.truncated: set[str] = set()

    async def __call__(self, messages: list[ChatMessage], tools: list[ToolSchema], n: int) -> list[str]:
        prompt = self.prompts.build(messages, tools)
        if prompt is None:
            raise RuntimeError("the state does not fit the local teacher's prompt budget")
        key = prompt_key(self.seed, LOCAL_TEACHER_PURPOSE, prompt.ids, self._asked)
        generations = await self.batcher.submit((prompt.ids, n, key))
        return reply_texts(self.decoder, generations, self.truncated)

    def _sample_batch(self, jobs: Sequence[tuple[np.ndarray, int, Any]]):
        d = self.decoding
        result = self.sampler.sample([j[0] for j in jobs], n=[j[1] for j in jobs], max_new_tokens=d["max_new_tokens"],
                                     temperature=d["temperature"], top_p=d["top_p"], top_k=d["top_k"],
                                     key=[j[2] for j in jobs])
        return result.generations

    def parse(self, text: str, tools: list[ToolSchema]) -> Action:
        return parse_reply(text, tools, self.truncated)


def prompt_key(seed: int, purpose: int, prompt_ids: np.ndarray, asked: dict[str, int], *prefix: int) -> jax.Array:
    """An in-process teacher's sampling key from (seed, purpose, *prefix, the prompt, how often
    this prompt was asked): never from the arrival order of async calls, and a regeneration of
    the same state gets a fresh key. Counts `asked` up."""
    digest = hashlib.sha256(np.asarray(prompt_ids, np.int32).tobytes()).hexdigest()
    count = asked.get(digest, 0)
    asked[digest] = count + 1
    key = jax.random.fold_in(jax.random.key(seed), purpose)
    for value in (*prefix, int(digest[:7], 16), count):
        key = jax.random.fold_in(key, value)
    return key


def reply_texts(decoder: Any, generations: Sequence[Any], truncated: set[str]) -> list[str]:
    """Decoded replies; those cut at max_new_tokens are remembered so `parse_reply` refuses them."""
    texts = []
    for g in generations:
        text = decoder.text(g.token_ids)
        if g.finish_reason == "length":
            truncated.add(text)
        texts.append(text)
    return texts


def parse_reply(text: str, tools: list[ToolSchema], truncated: set[str]) -> Action:
    from actionopd_jax.chat.actions import parse_teacher

    if text in truncated:
        return Invalid("teacher reply truncated at max_new_tokens")
    return parse_teacher(text, tools)


def weights_digest(path: Path) -> str:
    """A short fingerprint of the checkpoint (file names, sizes, mtimes): part of the teacher's
    identity, so cached samples of other weights at the same path are never served."""
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and (f.suffix in (".safetensors", ".json")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def build_hf_local_teacher(t: TeacherConfig, student_tokenizer: Any, *, mesh: Any, process_count: int, seed: int,
                           max_prompt_tokens: int, buckets: Any = None):
    """The LocalTeacher of `teacher.kind: local` (teacher.model: an HF Qwen3 directory), on the
    run's mesh; prompts within collect.max_prompt_tokens, keys from run.seed. One process
    only: each process collects its own share with different call counts, and a model
    sharded over several hosts would need lockstep calls."""
    from actionopd_jax.model.weights import load_hf
    from actionopd_jax.teacher.local_provider import LocalTeacher, LocalTeacherConfig

    path = Path(t.model) if t.model else None
    if path is None or not (path / "config.json").is_file():
        raise ConfigError("teacher.kind=local needs teacher.model = an HF Qwen3 checkpoint directory "
                          f"(config.json + safetensors); got {t.model!r}")
    if process_count > 1:
        raise ConfigError("teacher.kind=local runs on one process only; with several hosts serve the teacher "
                          "(vLLM, SGLang or `actionopd serve`) and set teacher.kind=openai with teacher.provider")
    tokenizer = student_tokenizer
    if (path / "tokenizer.json").is_file():
        from actionopd_jax.chat import load_tokenizer

        tokenizer = load_tokenizer(path)
    mcfg, model = load_hf(path, mesh=mesh)
    gen = HFLocalGenerator(model, mcfg, tokenizer, mesh=mesh, seed=seed,
                           max_prompt_tokens=max_prompt_tokens, max_new_tokens=t.max_tokens,
                           temperature=t.temperature, top_p=t.top_p, top_k=t.top_k,
                           enable_thinking=t.enable_thinking, buckets=buckets)
    local_cfg = LocalTeacherConfig(model=f"{path.resolve()}@{weights_digest(path)}", decoding=gen.decoding,
                                   max_regenerations=t.retries)
    return LocalTeacher(gen, local_cfg, parse_text=gen.parse)
