"""Shared pieces for the baseline tests (KD, OPD, Self-ActionOPD, ablations).

Training rows are kept short: BFCL prompts are ~4k tokens with the tiny tokenizer (full tool
schemas), far too slow to train on 2 CPU cores, so the training tests run on the small real
`ToyEnv` of the collector tests (two tools, ~150-token prompts) and BFCL is used where only
rendering / HTTP / scoring happens. The teacher of the toy tasks is a scripted policy served
by our loopback OpenAI-compatible server (real HTTP, real `openai` client).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from actionopd_jax.config.load import load_config
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice, tool_call_choice
from tests._collect_fixtures import ToyEnv, toy_task
from tests._subprocess_fixtures import RUN_OPTIMIZED

TOY_ANSWER = "The answer is 6."


def toy_teacher_backend(name: str = "toy-teacher", reasoning: str | None = None) -> ScriptedBackend:
    """Solves the toy task: add(2, 3) first, then answers. Tasks whose question says
    'case=fail' get a wrong closing message but still end (score 1 needs 'answered')."""

    def reply(req):
        if not any(m.get("role") == "tool" for m in req.messages):
            choice = tool_call_choice("add", {"a": 2, "b": 3})
            if reasoning:
                choice.reasoning_content = reasoning
            return choice
        return message_choice(TOY_ANSWER, reasoning=reasoning)

    return ScriptedBackend(name, reply)


def toy_tasks(n: int, case: str = "kd") -> list:
    return [toy_task(f"toy-{case}-{i}", case) for i in range(n)]


def toy_env_factory(task):
    return ToyEnv()


def toy_trajectories(base_url: str, tasks, *, model: str = "toy-teacher", trials: int = 1, out_jsonl=None):
    from actionopd_jax.baselines.kd import teacher_trajectories
    from actionopd_jax.eval.agents import EndpointAgent

    agent = EndpointAgent(base_url, model)
    return asyncio.run(teacher_trajectories(agent, tasks, toy_env_factory, trials=trials, out_jsonl=out_jsonl))


def tiny_run_config(tokenizer_dir: Path | str, *overrides: str):
    """A tiny CPU run: preset tiny (vocab 2176 >= the 2048-token tiny tokenizer), 8-row
    microbatches over the 8 test devices, no TensorBoard / progress bars."""
    base = ["model.preset=tiny", f"model.tokenizer={tokenizer_dir}", "train.lr=1e-2", "train.weight_decay=0.0",
            "train.minibatch_rows=8", "train.microbatch_rows=8", "train.max_seq_len=1024", "train.bucket_multiple=64",
            "run.progress=false", "run.tensorboard=false", "checkpoint.async_save=false",
            "collect.temperature=1.0", "collect.max_response_tokens=32", "collect.max_prompt_tokens=512"]
    return load_config(None, base + list(overrides))


def full_logprobs(model, ids: np.ndarray) -> np.ndarray:
    """log_softmax of one full causal forward over `ids`: row i = log p(. | ids[:i+1])."""
    import jax
    import jax.numpy as jnp

    tokens = jnp.asarray(np.asarray(ids, np.int32)[None])
    positions = jnp.arange(tokens.shape[1])[None]
    hidden, _ = model(tokens, positions)
    return np.asarray(jax.nn.log_softmax(model.logits(hidden)[0].astype(jnp.float32), axis=-1))


def direct_target_logprobs(model, prompt: np.ndarray, target: np.ndarray) -> np.ndarray:
    """log p(target tokens | prompt, earlier target tokens) by one full forward."""
    seq = np.concatenate([prompt, target]).astype(np.int32)
    lp = full_logprobs(model, seq)
    p = len(prompt)
    return lp[np.arange(p - 1, p - 1 + len(target)), target]


def fit_student(examples, vocab_size: int, *, seed: int, steps: int, lr: float = 1e-2):
    """A tiny Qwen3 (preset tiny) fitted to KD examples with a plain optax loop: a quick warm
    start for tests that need a student whose samples are often valid actions (the KD path
    itself is tested through the trainer in test_baselines_kd.py). Returns (model, losses)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from actionopd_jax.model import PRESETS, Qwen3

    cfg = PRESETS["tiny"]
    assert vocab_size <= cfg.vocab_size
    length = max(e.prompt_ids.size + e.target_ids.size for e in examples)
    tokens = np.zeros((len(examples), length), np.int32)
    mask = np.zeros((len(examples), length), np.float32)
    for i, e in enumerate(examples):
        seq = np.concatenate([e.prompt_ids, e.target_ids])
        tokens[i, : seq.size] = seq
        mask[i, e.prompt_ids.size: seq.size] = 1.0  # loss on target tokens only
    model = Qwen3(cfg, rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
    positions = np.broadcast_to(np.arange(length), tokens.shape)

    graphdef, state = nnx.split((model, opt))

    def step(state, tokens, positions, mask):
        model, opt = nnx.merge(graphdef, state)

        def loss_fn(model):
            hidden, _ = model(tokens[:, :-1], positions[:, :-1])
            logp = jax.nn.log_softmax(model.logits(hidden).astype(jnp.float32), -1)
            nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
            return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss, nnx.state((model, opt))

    # one program run `steps` times: compiled at XLA's default level, not the suite's -O0
    # (tests/_subprocess_fixtures.py), it runs ~2x faster for ~6 s more compile
    step = jax.jit(step, donate_argnums=0, compiler_options=RUN_OPTIMIZED)
    losses = []
    for _ in range(steps):
        loss, state = step(state, tokens, positions, mask)
        losses.append(float(loss))
    nnx.update((model, opt), state)
    return model, losses
