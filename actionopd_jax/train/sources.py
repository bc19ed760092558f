"""Where the trainer's state groups come from: a small protocol and the sources behind it.

The loop only needs an object with
    collect(step, policy) -> list[StateGroup]   # this process's groups, rewards set
    state_dict() -> dict / load_state_dict(d)   # task-iterator state (JSON), for resume
    metrics() -> dict[str, float]               # optional, about the last collect
The trainer never picks a source: its caller hands one in (`Trainer(cfg, source=...)`), either
built or as a factory of the trainer's `SourceContext`. "synthetic" is the deterministic
stand-in below; the command layer maps `collect.kind` to the collector or a baseline
(actionopd_jax.baselines.wiring.build_source).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from actionopd_jax.config import Config, SyntheticConfig
from actionopd_jax.types import Candidate, Invalid, Message, StateGroup


@dataclass
class Policy:
    """The behaviour snapshot a source samples from (one per collection step).

    `params` live on the training mesh and are DONATED to the update that follows `collect`:
    use (or reshard/copy) them inside `collect`, never keep them for later steps.
    """

    graphdef: Any
    params: Any  # pure-dict parameters on the training mesh
    model_config: Any  # actionopd_jax.model.Qwen3Config
    step: int
    key: Any = None  # PRNG key of this collection step: fold_in(key(run.seed), step)


class RunStop(Exception):
    """A group source's reason to end the run now (a teacher outage, say): `actionopd train`
    prints it and exits 1. The steps finished before it are checkpointed as usual."""


class StoppedEarly(Exception):
    """A phase's trainer (the KD warm start, the main job's ActionOPD phase, a KD run) stopped
    before its last step with its state saved: SIGTERM / preemption, or a run.budget_* stop.
    `actionopd train` prints the message and exits with `code`, the trainer's own exit code
    (train.loop.SIGTERM_EXIT_CODE / BUDGET_EXIT_CODE), with no traceback (issue 46 item 8)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = int(code)


@dataclass
class SourceContext:
    """What a source may need to build itself."""

    model_config: Any
    run_dir: str
    tokenizer_path: str
    process_index: int
    process_count: int
    mesh: Any = None


@runtime_checkable
class GroupSource(Protocol):
    def collect(self, step: int, policy: Policy) -> list[StateGroup]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StepIndexedSource:
    """Base of the sources whose data is a function of (seed, step) alone (synthetic, KD):
    resuming needs only the next step to collect, and metrics() reports the last collect.
    Shared so those sources save and restore the same JSON state."""

    def __init__(self) -> None:
        self.next_step = 0
        self._last: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_step = int(state.get("next_step", 0))

    def metrics(self) -> dict[str, float]:
        return dict(self._last)


class SyntheticGroupSource(StepIndexedSource):
    """Deterministic state groups from (seed, step, process): random prompt/response ids,
    rewards drawn from the reward values of eq. 6 (-1, 0, 1, 1.25, 1.5), and sampler/teacher
    logprobs that are placeholders, not scores of any model.

    It stands in for the collector in tests, --smoke and benchmarks: the trainer sees the
    same data types and shapes it will get from real collection. Use it with
    train.old_logprobs=recompute (its sampler logprobs do not describe the policy).
    """

    REWARD_VALUES = np.array([-1.0, 0.0, 1.0, 1.25, 1.5])

    def __init__(self, cfg: SyntheticConfig, *, seed: int, num_candidates: int, vocab_size: int,
                 process_index: int = 0, process_count: int = 1):
        super().__init__()
        self.cfg = cfg
        self.seed = int(seed)
        self.n = int(num_candidates)
        self.vocab = int(vocab_size)
        self.process_index = process_index
        self.process_count = process_count

    def _rng(self, step: int, group: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, step, self.process_index, group])

    def collect(self, step: int, policy: Policy | None = None) -> list[StateGroup]:
        c = self.cfg
        groups = []
        for gi in range(c.groups_per_step):
            rng = self._rng(step, gi)
            prompt = rng.integers(0, self.vocab, rng.integers(c.prompt_tokens_min, c.prompt_tokens_max + 1))
            cands = []
            for _ in range(self.n):
                n_resp = int(rng.integers(c.response_tokens_min, c.response_tokens_max + 1))
                reward = float(rng.choice(self.REWARD_VALUES))
                cands.append(Candidate(
                    token_ids=rng.integers(0, self.vocab, n_resp).astype(np.int32),
                    logprobs=-rng.uniform(0.1, 4.0, n_resp).astype(np.float32),
                    text="", action=Invalid("synthetic") if reward < 0 else Message("synthetic"),
                    reward=reward,
                    teacher_logprobs=-rng.uniform(0.1, 4.0, n_resp).astype(np.float32),
                ))
            rewards = np.array([x.reward for x in cands])
            keep = bool(np.ptp(rewards) > 1e-8)
            groups.append(StateGroup(
                task_id=f"synthetic-{self.process_index}-{gi}", decision_index=0,
                prompt_ids=prompt.astype(np.int32), candidates=cands, teacher_samples=[],
                committed_index=int(np.argmax(rewards)), retained=keep,
                drop_reason="" if keep else "equal_rewards"))
        self.next_step = step + 1
        self._last = {"groups": float(len(groups)), "groups_retained": float(sum(g.retained for g in groups))}
        return groups


def synthetic_source(cfg: Config, ctx: SourceContext) -> SyntheticGroupSource:
    """The synthetic source of `cfg` (collect.kind=synthetic) in the trainer's context; pass it
    as `Trainer(..., source=functools.partial(synthetic_source, cfg))`."""
    return SyntheticGroupSource(cfg.collect.synthetic, seed=cfg.run.seed, num_candidates=cfg.collect.num_candidates,
                                vocab_size=ctx.model_config.vocab_size, process_index=ctx.process_index,
                                process_count=ctx.process_count)
