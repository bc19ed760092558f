"""`actionopd compare`: what is compared, and the budget every method gets.

Methods (paper tables 2 and 3, in miniature), all started from ONE shared warm start:
  actionopd      the state-group collector with the ActionOPD reward (r_lambda), argmax commit
  actionopd_async the same, asynchronous (issue 44): episodes run on across updates, trained on
                 while at most eta = `compare.max_staleness` (default 1) updates stale
                 (collect.max_staleness; docs/decisions.md, "The asynchronous scheduler")
  validity       ablation: reward = 1 for any valid action, -1 otherwise (collect.reward=validity)
  binary         ablation: reward = 1 if the action matches a teacher sample, else 0 (collect.reward=binary)
  random_commit  ablation: the environment advances with a random candidate (collect.commit=random)
  kd             KD as paper B.4 runs it: each step, kd.trials fresh teacher episodes per task start,
                 the successful ones' teacher turns trained with ActionOPD's optimizer and minibatch
  opd            token-level OPD: needs the teacher's token logprobs (a local or served teacher model)
  self_actionopd Self-ActionOPD: the student itself, with privileged context, is the teacher

Budget, held equal EXACTLY: `compare.updates` optimizer updates per run, each over at most
train.minibatch_rows rows (KD: exactly that many teacher turns per update). An ActionOPD-style
run collects as many steps as it needs to reach the budget; in the step that would exceed it,
`UpdateBudget` keeps a seeded random subset of the learning groups so that the update count
lands on the budget, and drops the others (drop reason "over_budget"); KD's fresh examples are
trimmed the same way. An asynchronous run counts the same way: its draws ahead
are admitted early, but a draw's groups reach the budget only at the step that trains them;
when the budget is spent the runner stops the draws still in flight (never trained, so never
counted). Teacher samples are NOT held equal (KD asks for whole episodes, one
sample per teacher turn; the on-policy methods ask for K at every state they visit); every run
reports how many it used.

The `compare:` section of a compare preset (configs/compare/compare_tiny.yaml) holds these settings;
the rest of the file is an ordinary run config (the main job's `experiment:` section sets the
student, tasks, warm start and evaluation).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actionopd_jax.config import Config, ConfigError


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "actionopd" (the collector, with `overrides`) | "kd" | "opd" | "self"
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("actionopd", "actionopd", "ActionOPD"),
    # eta comes from compare.max_staleness (resolve_method): one setting beside the budget, and
    # the label says which eta ran; the override here is its default
    Method("actionopd_async", "actionopd", "ActionOPD, eta=1", {"collect.max_staleness": 1}),
    Method("kd", "kd", "KD (fresh teacher episodes)"),
    Method("validity", "actionopd", "ablation: validity reward", {"collect.reward": "validity"}),
    Method("binary", "actionopd", "ablation: binary reward", {"collect.reward": "binary"}),
    Method("random_commit", "actionopd", "ablation: random commit", {"collect.commit": "random"}),
    Method("opd", "opd", "token-level OPD"),
    Method("self_actionopd", "self", "Self-ActionOPD"),
)}


@dataclass(frozen=True)
class CompareSettings:
    methods: tuple[str, ...] = ("actionopd", "kd", "validity", "binary", "random_commit", "opd", "self_actionopd")
    seeds: tuple[int, ...] = (0, 1, 2)
    updates: int = 12  # optimizer updates per run (the budget held equal)
    max_steps: int = 0  # collection steps an on-policy run may take to reach it (0: 4 x updates)
    lr: float = 0.0  # every method's lr (0: experiment.opd_lr, else train.lr)
    max_staleness: int = 1  # eta of actionopd_async (the asynchronous ActionOPD method), >= 1
    # Task starts per collection step (0: every training task once, the main job's phase). Fewer
    # starts make a run take several collection steps to spend its updates, which is what an
    # asynchronous run needs to overlap anything.
    task_starts_per_step: int = 0
    # Tasks cut to their first n user turns (0: whole tasks): the training tasks (collection,
    # the warm start's trajectories), and each held-out evaluation (every final policy is
    # evaluated once per entry; the first entry is the headline).
    train_user_turns: int = 0
    eval_user_turns: tuple[int, ...] = (0, 1)
    name: str = "compare"  # run directory runs/<utc>-<name>

    @property
    def step_cap(self) -> int:
        return self.max_steps or 4 * self.updates


def _settings_from(data: dict[str, Any]) -> CompareSettings:
    names = {f.name for f in dataclasses.fields(CompareSettings)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown compare key(s) {unknown}; expected some of {sorted(names)}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        default = getattr(CompareSettings, key) if key not in ("methods", "seeds", "eval_user_turns") else ()
        try:
            if key == "methods":
                value = tuple(str(v) for v in (value.split(",") if isinstance(value, str) else value))
            elif key in ("seeds", "eval_user_turns"):
                value = tuple(int(v) for v in (str(value).split(",") if isinstance(value, (str, int)) else value))
            elif isinstance(default, bool):
                value = bool(value)
            elif isinstance(default, int):
                value = int(value)
            elif isinstance(default, float):
                value = float(value)
            else:
                value = str(value)
        except (TypeError, ValueError):
            raise ConfigError(f"compare.{key}={value!r} has the wrong type") from None
        out[key] = value
    s = CompareSettings(**out)
    validate_settings(s)
    return s


def validate_settings(s: CompareSettings) -> None:
    bad = [m for m in s.methods if m not in METHODS]
    if bad:
        raise ConfigError(f"compare.methods: unknown method(s) {bad}; choose from {list(METHODS)}")
    if not s.methods or len(set(s.methods)) != len(s.methods):
        raise ConfigError(f"compare.methods must name each method once, got {list(s.methods)}")
    if not s.seeds or len(set(s.seeds)) != len(s.seeds):
        raise ConfigError(f"compare.seeds must be distinct seeds (e.g. [0, 1, 2]), got {list(s.seeds)}")
    if s.max_staleness < 1:
        raise ConfigError(f"compare.max_staleness is actionopd_async's eta and must be >= 1 (eta=0 is the "
                          f"method actionopd), got {s.max_staleness}")
    if s.updates < 1 or s.max_steps < 0 or s.train_user_turns < 0 or s.lr < 0 or s.task_starts_per_step < 0:
        raise ConfigError("compare.updates must be >= 1; compare.max_steps, train_user_turns, lr and "
                          "task_starts_per_step >= 0")
    if not s.eval_user_turns or min(s.eval_user_turns) < 0 or len(set(s.eval_user_turns)) != len(s.eval_user_turns):
        raise ConfigError(f"compare.eval_user_turns must be distinct turn counts >= 0 (0: whole tasks), "
                          f"got {list(s.eval_user_turns)}")


def resolve_method(name: str, s: CompareSettings) -> Method:
    """METHODS[name] with the settings it takes: an asynchronous method's eta is
    compare.max_staleness, and its label says so."""
    m = METHODS[name]
    if "collect.max_staleness" not in m.overrides:
        return m
    return dataclasses.replace(m, label=f"ActionOPD, eta={s.max_staleness}",
                               overrides={**m.overrides, "collect.max_staleness": s.max_staleness})


def check_method_configs(cfg: Config, s: CompareSettings) -> None:
    """Each collector method's overrides on the run config, as its ActionOPD phase sets it
    (collect.kind=actionopd, experiment/phases.py), pass the config checks (e.g. eta >= 1 needs
    train.old_logprobs=recompute): a bad pairing is refused before the warm start, not after."""
    from actionopd_jax.config.load import replace_keys

    for name in s.methods:
        m = resolve_method(name, s)
        if m.overrides and m.kind == "actionopd":
            try:
                replace_keys(cfg, **{"collect.kind": "actionopd", **m.overrides})
            except ConfigError as e:
                raise ConfigError(f"compare method {name} ({', '.join(f'{k}={v}' for k, v in m.overrides.items())}) "
                                  f"on this run config: {e}") from None


def eval_name(turns: int) -> str:
    """Name of a held-out evaluation: 'whole' tasks or their 'first<n>' user turns."""
    return f"first{turns}" if turns else "whole"


def load_compare(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, CompareSettings]:
    """A compare preset: its `compare:` section and the run config around it. Overrides
    `compare.k=v` go to the compare settings, every other `a.b=c` to the run config."""
    import tempfile

    import yaml

    from actionopd_jax.config.load import load_config, parse_override

    compare: dict[str, Any] = {}
    run_path = None
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"compare preset {p} does not exist")
        raw = yaml.safe_load(p.read_text()) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        compare = dict(raw.pop("compare", None) or {})
        if "base" in raw and isinstance(raw["base"], str):  # relative to the preset, as in any config
            raw["base"] = str((p.parent / raw["base"]).resolve())
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(raw, f)
            run_path = f.name
    rest = []
    for o in overrides:
        key, value = parse_override(o)
        if key.startswith("compare."):
            compare[key.split(".", 1)[1]] = value
        else:
            rest.append(o)
    try:
        cfg = load_config(run_path, rest)
    finally:
        if run_path:
            Path(run_path).unlink(missing_ok=True)
    if not cfg.experiment.enabled:
        raise ConfigError("actionopd compare builds on the main job's experiment: section; set experiment.enabled=true")
    settings = _settings_from(compare)
    check_method_configs(cfg, settings)
    return cfg, settings


def not_runnable(method: Method, *, privileged_teacher: bool) -> str:
    """Why `method` cannot run in this setting ("" when it can)."""
    if method.kind == "opd" and privileged_teacher:
        return ("needs the teacher's token log-probabilities; the teacher here is the privileged reference "
                "server, which returns actions, not a token distribution (no local teacher model in the tiny "
                "setting)")
    if method.kind == "self":
        return ("its teacher is the student itself reading privileged notes; in miniature that is the 2-layer "
                "random-init student, never trained to read such notes, so its 'teacher' samples would be its own "
                "noise, at up to 4,096 teacher tokens per sample (table 8) on CPU; the harness does not run it. "
                "Its tau2 recipe: configs/paper/self_actionopd_tau2_qwen3_4b_h200.yaml")
    return ""


# --- the update budget ---------------------------------------------------------------------------

def rows_of(group: Any) -> int:
    """Training rows a retained group gives (one per candidate with a non-empty response)."""
    return sum(1 for c in group.candidates if np.asarray(c.token_ids).size > 0)


class UpdateBudget:
    """The collector source, trimmed so that a run's optimizer updates end exactly on the
    budget. `remaining` is set by the runner before each step (budget - updates done); groups
    beyond remaining x minibatch_rows rows are dropped, a seeded random choice."""

    def __init__(self, inner: Any, *, minibatch_rows: int, seed: int):
        self.inner, self.minibatch_rows, self.seed = inner, int(minibatch_rows), int(seed)
        self.remaining = 0
        self.trimmed_groups = 0

    def collect(self, step: int, policy: Any):
        groups = self.inner.collect(step, policy)
        room = self.remaining * self.minibatch_rows
        learning = [g for g in groups if g.retained]
        if sum(rows_of(g) for g in learning) <= room:
            return groups
        rng = np.random.default_rng([self.seed, step, 0xB0D6E7])
        used = 0
        for i in rng.permutation(len(learning)):
            g = learning[int(i)]
            n = rows_of(g)
            if used + n <= room:
                used += n
            else:
                g.retained, g.drop_reason = False, "over_budget"
                self.trimmed_groups += 1
        return groups

    def __getattr__(self, name: str) -> Any:  # state_dict, metrics, history, close ...
        return getattr(self.inner, name)


def expected_updates(rows: int, minibatch_rows: int) -> int:
    return math.ceil(rows / minibatch_rows) if rows else 0
