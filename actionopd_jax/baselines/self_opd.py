"""Self-ActionOPD (paper 3.6, B.5): the teacher is the CURRENT student weights, given privileged
task information the student never sees.

- Teacher and student share parameters but sample independently: at every collection step the
  teacher samples from exactly the behaviour snapshot the student samples from (read from the
  student's sampler at sampling time), so updated weights are used at the next step; teacher
  samples and verdicts are fixed in the groups before the update (the collector's contract).
- No teacher cache: every step asks the current weights again (the paper clears the
  self-teacher cache at each collection step); the identity names the step ("self@step-N").
- Privileged context (teacher-only) = guidance + the task's private information
  (baselines/privileged.py: an explicit `payload["privileged_context"]`, BFCL reference calls
  per turn, or for tau2 the reviewed summary from `teacher.privileged_summaries` plus, from the
  evaluation criteria, the reference actions, customer-side operations, target states and
  required messages and outcomes). It goes into the teacher's copy of the
  system message (LocalTeacher); the student's prompt, the matcher and the training rows never
  contain it. The teacher's prompt budget is the student's plus `TEACHER_EXTRA_TOKENS`.
- Generation (paper table 8, "Self Teacher"): T 0.6, p 0.95, k 20, thinking on, a 4,096-token
  response limit (teacher.max_tokens; configs/paper/self_actionopd_tau2_qwen3_4b_h200.yaml).
- Training uses the ActionOPD reward on student candidates only (teacher outputs never become
  rows: `train.batching.rows_from_groups` reads candidates).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Sequence

from flax import nnx

from actionopd_jax.baselines.privileged import load_summaries, privileged_context
from actionopd_jax.collect.source import ActionOPDGroupSource
from actionopd_jax.config import Config
from actionopd_jax.teacher.hf_local import parse_reply, prompt_key, reply_texts
from actionopd_jax.train.sources import SourceContext
from actionopd_jax.types import Action, ChatMessage, Task, ToolSchema

log = logging.getLogger(__name__)

TEACHER_EXTRA_TOKENS = 4096  # paper B.5: teacher prompts may be 4,096 tokens longer than the student's
SELF_TEACHER_PURPOSE = 32  # fold_in constant: teacher keys are independent of student / commit keys

GUIDANCE = (
    "Privileged teacher notes (you see these; the assistant you are supervising does not). "
    "Choose the single best next step for the assistant: one tool call or one message. Check "
    "preconditions and the user's authorization before acting, ask when required information is "
    "missing instead of guessing, and do not repeat a step that already succeeded. The facts below "
    "are for deciding; still obtain any confirmation and evidence the conversation requires.")


@dataclasses.dataclass(frozen=True)
class SelfTeacherSettings:
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    max_new_tokens: int = 4096
    enable_thinking: bool = True
    max_prompt_tokens: int = 32768  # the teacher's own budget (student's + TEACHER_EXTRA_TOKENS)
    guidance: str = GUIDANCE


def self_teacher_settings(cfg: Config) -> SelfTeacherSettings:
    """The self-teacher's generation settings from teacher.* (table 8: max_tokens 4,096)."""
    t = cfg.teacher
    return SelfTeacherSettings(temperature=t.temperature, top_p=t.top_p, top_k=t.top_k, max_new_tokens=t.max_tokens,
                               enable_thinking=t.enable_thinking,
                               max_prompt_tokens=cfg.collect.max_prompt_tokens + TEACHER_EXTRA_TOKENS)


class SelfTeacher:
    """A `Teacher` over the student's current weights (see the module docstring).

    `weights`: returns (model, mesh) the student samples with right now; it is read at every
    teacher device call. `observe(step, model)`: optional hook called with the weights of
    each step's first teacher call (tests check they are the current student weights)."""

    def __init__(self, tokenizer: Any, model_config: Any, weights: Callable[[], tuple[Any, Any]], *, seed: int,
                 eos_ids: Sequence[int], settings: SelfTeacherSettings, buckets: Any = None,
                 observe: Callable[[int, Any], None] | None = None, summaries: Mapping[str, str] | None = None):
        from actionopd_jax.chat.prompt import CandidateDecoder, PromptBuilder
        from actionopd_jax.sampling import Sampler
        from actionopd_jax.sampling.batching import MicroBatcher
        from actionopd_jax.teacher.local_provider import LocalTeacher, LocalTeacherConfig

        self.settings = settings
        self.summaries = dict(summaries or {})  # tau2 task id -> prepared privileged summary
        self.seed = int(seed)
        self.weights = weights
        self.observe = observe
        self.sampler = Sampler(None, model_config, eos_ids=list(eos_ids), buckets=buckets)
        self._loaded: Any = None  # the student model whose weights self.sampler holds
        self.prompts = PromptBuilder(tokenizer, max_prompt_tokens=settings.max_prompt_tokens,
                                     enable_thinking=settings.enable_thinking)
        self.decoder = CandidateDecoder(tokenizer, eos_ids=list(eos_ids))
        self.batcher = MicroBatcher(self._sample_batch, window_s=0.005, max_items=64)
        decoding = {k: getattr(settings, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "enable_thinking")}
        self.local = LocalTeacher(self._generate, LocalTeacherConfig(model="self@step-0", decoding=decoding,
                                                                     privileged_context=settings.guidance),
                                  parse_text=self._parse)
        self.step = 0
        self._privileged: dict[str, str] = {}
        self._truncated: set[str] = set()
        self._calls: dict[str, int] = {}
        self._observed_step = -1
        self.teacher_prompts: list[list[ChatMessage]] = []  # this step's teacher conversations (with privileged text)

    # --- per step ----------------------------------------------------------------------------
    def begin_step(self, step: int, tasks: Sequence[Task]) -> None:
        """New collection step: forget every earlier answer (no cache across weight versions)."""
        self.step = int(step)
        self.local.cfg = dataclasses.replace(self.local.cfg, model=f"self@step-{step}")
        self._privileged = {t.task_id: privileged_context(t, self.summaries) for t in tasks}
        self._truncated.clear()
        self._calls.clear()
        self.teacher_prompts = []

    # --- Teacher protocol ---------------------------------------------------------------------
    @property
    def identity(self) -> dict[str, Any]:
        return self.local.identity

    @property
    def usage(self):
        return self.local.usage

    async def sample_detailed(self, messages: list[ChatMessage], tools: list[ToolSchema], k: int, *,
                              key_info: dict[str, Any] | None = None):
        info = dict(key_info or {})
        info["privileged_context"] = self._privileged.get(str(info.get("task_id")), "")
        return await self.local.sample_detailed(messages, tools, k, key_info=info)

    async def sample(self, messages, tools, k, *, key_info=None):
        return (await self.sample_detailed(messages, tools, k, key_info=key_info)).samples

    # --- generation ---------------------------------------------------------------------------
    def _parse(self, text: str, tools: list[ToolSchema]) -> Action:
        return parse_reply(text, tools, self._truncated)

    async def _generate(self, messages: list[ChatMessage], tools: list[ToolSchema], n: int) -> list[str]:
        prompt = self.prompts.build(messages, tools)
        if prompt is None:
            raise RuntimeError(f"the teacher prompt with privileged context exceeds its budget of "
                               f"{self.settings.max_prompt_tokens} tokens")
        self.teacher_prompts.append(prompt.messages)
        # keys from (seed, step, the teacher prompt, how often it was asked this step)
        key = prompt_key(self.seed, SELF_TEACHER_PURPOSE, prompt.ids, self._calls, self.step)
        generations = await self.batcher.submit((prompt.ids, n, key))
        return reply_texts(self.decoder, generations, self._truncated)

    def _sample_batch(self, jobs):
        model, mesh = self.weights()  # the student's current snapshot, shared, never copied
        if model is None:
            raise RuntimeError("the student's weights are not set: Self-ActionOPD samples only during collection")
        if model is not self._loaded:  # once per student snapshot, not per batch
            self.sampler.load_policy(*nnx.split(model), mesh)
            self._loaded = model
        if self.observe is not None and self._observed_step != self.step:
            self._observed_step = self.step
            self.observe(self.step, model)
        s = self.settings
        result = self.sampler.sample([j[0] for j in jobs], n=[j[1] for j in jobs], max_new_tokens=s.max_new_tokens,
                                     temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, key=[j[2] for j in jobs])
        return result.generations


class _StepTasks:
    """The task stream, telling the teacher which tasks (hence which privileged context) a
    step has as soon as the step draws them."""

    def __init__(self, stream: Any, on_step: Callable[[list[Task]], None]):
        self.stream, self.on_step = stream, on_step

    def next_step(self) -> list[Task]:
        tasks = self.stream.next_step()
        self.on_step(tasks)
        return tasks

    def get_state(self):
        return self.stream.get_state()

    def set_state(self, state) -> None:
        self.stream.set_state(state)


class SelfActionOPDGroupSource(ActionOPDGroupSource):
    """The ActionOPD group source with the SelfTeacher in place of an external teacher."""

    def __init__(self, cfg: Config, ctx: SourceContext, *, matcher: Any = None, stream: Any = None, env_factory: Any = None,
                 tokenizer: Any = None, buckets: Any = None, teacher_buckets: Any = None,
                 observe: Callable[[int, Any], None] | None = None):
        from actionopd_jax.collect.source import tokenizer_from, train_task_stream

        if tokenizer is None:
            tokenizer = tokenizer_from(ctx, needed_by="this baseline")
        eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        summaries = load_summaries(cfg.teacher.privileged_summaries) if cfg.teacher.privileged_summaries else {}
        self.self_teacher = SelfTeacher(tokenizer, ctx.model_config, self._student_weights, seed=cfg.run.seed,
                                        eos_ids=[eos], settings=self_teacher_settings(cfg), buckets=teacher_buckets,
                                        observe=observe, summaries=summaries)
        self._step = 0
        stream = _StepTasks(stream if stream is not None else train_task_stream(cfg),
                            lambda tasks: self.self_teacher.begin_step(self._step, tasks))
        super().__init__(cfg, ctx, teacher=self.self_teacher, matcher=matcher, stream=stream,
                         env_factory=env_factory, tokenizer=tokenizer, buckets=buckets)

    def _student_weights(self) -> tuple[Any, Any]:
        return self.sampler.model, self.sampler.mesh

    def collect(self, step: int, policy: Any):
        self._step = step
        return super().collect(step, policy)


def build_self_source(cfg: Config, ctx: SourceContext) -> SelfActionOPDGroupSource:
    return SelfActionOPDGroupSource(cfg, ctx)
