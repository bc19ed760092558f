"""The settings one evaluation runs under: a recipe's `eval:` section (config/eval_section.py:
the paper's table 8 evaluation rows and B.3's limits), or its paper defaults without a recipe,
with each command-line flag given laid over it.

Which row applies: `--checkpoint` / `--hf` evaluate a student (`eval.student`); `--endpoint`
evaluates a model behind an API, by default as a directly evaluated teacher (`eval.teacher`),
or as a served student with `--settings student`. The tau2 user is `eval.user` either way.

The resolved settings are written to `settings.json` next to the scores and into
`results.json`, so every score says what it ran under; an output directory that holds
episodes of other settings is not resumed into (`check_same_settings`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from actionopd_jax.config.eval_section import EvalConfig
from actionopd_jax.config.schema import flatten
from actionopd_jax.providers import PROVIDERS, refusal, unsendable
from actionopd_jax.types import Task

ROLES = ("student", "teacher")
THINKING = {"on": True, "off": False, "none": None}


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """How the evaluated model is asked (one row of table 8)."""
    role: str  # "student" | "teacher" | "reference" (the privileged policy: nothing is sampled)
    temperature: float | None
    top_p: float | None
    top_k: int | None
    enable_thinking: bool | None
    max_tokens: int
    provider: str = ""
    reasoning_effort: str = ""


@dataclasses.dataclass(frozen=True)
class UserSettings:
    """The tau2 (and conversational EnvScaler) user simulator's endpoint and sampling."""
    model: str
    base_url: str
    api_key_env: str  # the variable's name, never its value
    provider: str
    temperature: float
    top_p: float | None
    top_k: int | None
    enable_thinking: bool | None
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    source: str  # the recipe file, or "paper defaults (no --config)"
    benchmarks: tuple[str, ...]
    trials: int
    bfcl_trials: int
    bfcl_max_steps_per_turn: int
    model: ModelSettings
    user: UserSettings
    nl_assertions: str = "off"  # tau2: always off, as in every tau2 score of the paper (envs/tau2_score.py)
    tau2_prompts: str = "tau2"  # tau2's own harness prompts, or "actionopd" (ours): envs/tau2_prompts.py

    def trials_for(self, task: Task) -> int:
        return self.bfcl_trials if task.env == "bfcl" else self.trials

    def record(self) -> dict[str, Any]:
        """What settings.json and results.json hold: everything but the recipe's path (the same
        settings from another file are the same settings)."""
        out = dataclasses.asdict(self)
        out.pop("source")
        return out

    def lines(self) -> list[str]:
        """The listing `actionopd eval --check` prints."""
        m, u = self.model, self.user
        sampling = "greedy (T=0)" if m.temperature == 0 else ", ".join(
            f"{k}={v}" for k, v in (("T", m.temperature), ("p", m.top_p), ("k", m.top_k)) if v is not None) or \
            "the endpoint's defaults"
        if m.reasoning_effort:
            sampling += f", reasoning_effort={m.reasoning_effort}"
        user_sampling = ", ".join(f"{k}={v}" for k, v in (("T", u.temperature), ("p", u.top_p), ("k", u.top_k))
                                  if v is not None)
        return [
            f"evaluation settings ({self.source})",
            f"  {m.role:<8} thinking {_on(m.enable_thinking)}; {sampling}; {m.max_tokens:,} new tokens per reply"
            + (f"; provider {m.provider}" if m.provider else ""),
            f"  tau user {u.model or '(no model: tau2 needs --user-sim-model)'} at {u.base_url or '(no --user-sim-url)'}"
            f"; thinking {_on(u.enable_thinking)}; {user_sampling}; {u.max_tokens:,} tokens"
            + (f"; provider {u.provider}" if u.provider else ""),
            f"  trials   {self.trials} per tau2 / EnvScaler / AWM task (pass^1..pass^{self.trials}); "
            f"BFCL {self.bfcl_trials}, at most {self.bfcl_max_steps_per_turn} steps per turn",
            f"  tau2     natural-language assertions {self.nl_assertions}; "
            + ("tau2's own agent and user prompts" if self.tau2_prompts == "tau2"
               else "actionopd's agent and user prompts (not tau2's: not comparable with its leaderboard)"),
        ]


def _on(flag: bool | None) -> str:
    return "on" if flag else ("off" if flag is False else "not sent")


def resolve(args: argparse.Namespace, section: EvalConfig, source: str) -> EvalSettings:
    """`section` with every flag the user gave laid over it (argparse defaults are None)."""
    if args.reference:
        role = "reference"
    else:
        role = args.settings or ("teacher" if args.endpoint else "student")
    row = section.teacher if role == "teacher" else section.student
    given = lambda flag, value: value if getattr(args, flag) is None else getattr(args, flag)  # noqa: E731
    thinking = row.enable_thinking if args.thinking is None else THINKING[args.thinking]
    model = ModelSettings(
        role=role, temperature=given("temperature", row.temperature), top_p=given("top_p", row.top_p),
        top_k=given("top_k", row.top_k), enable_thinking=thinking, max_tokens=given("max_new_tokens", row.max_tokens),
        provider=given("provider", row.provider),
        reasoning_effort=given("reasoning_effort", getattr(row, "reasoning_effort", "")))
    u = section.user
    user = UserSettings(
        model=given("user_sim_model", u.model), base_url=given("user_sim_url", u.base_url),
        api_key_env=given("user_sim_api_key_env", u.api_key_env), provider=given("user_sim_provider", u.provider),
        temperature=given("user_sim_temperature", u.temperature), top_p=given("user_sim_top_p", u.top_p),
        top_k=given("user_sim_top_k", u.top_k),
        enable_thinking=u.enable_thinking if args.user_sim_thinking is None else THINKING[args.user_sim_thinking],
        max_tokens=given("user_sim_max_tokens", u.max_tokens))
    settings = EvalSettings(
        source=source, benchmarks=tuple(args.bench) if args.bench else section.benchmarks,
        trials=given("trials", section.trials), bfcl_trials=given("bfcl_trials", section.bfcl_trials),
        bfcl_max_steps_per_turn=given("bfcl_max_steps", section.bfcl_max_steps_per_turn), model=model, user=user,
        tau2_prompts=getattr(args, "tau2_prompts", None) or section.tau2_prompts)
    problems = settings_problems(settings, endpoint=bool(args.endpoint))
    if problems:
        raise ValueError("the evaluation settings cannot run:\n" + "\n".join(f"  - {p}" for p in problems))
    return settings


def settings_problems(s: EvalSettings, *, endpoint: bool) -> list[str]:
    """Each reason these settings cannot run, as one line saying what to change."""
    out = []
    if not s.benchmarks:
        out.append("no benchmark: pass --bench, or --config with a recipe whose eval.benchmarks names some")
    for key, v in (("--trials", s.trials), ("--bfcl-trials", s.bfcl_trials), ("--bfcl-max-steps", s.bfcl_max_steps_per_turn),
                   ("--max-new-tokens", s.model.max_tokens), ("--user-sim-max-tokens", s.user.max_tokens)):
        if v < 1:
            out.append(f"{key} must be >= 1, got {v}")
    if s.tau2_prompts not in ("tau2", "actionopd"):
        out.append(f"--tau2-prompts must be tau2 or actionopd, got {s.tau2_prompts!r}")
    if s.model.temperature is not None and s.model.temperature < 0:
        out.append(f"--temperature must be >= 0, got {s.model.temperature}")
    # an endpoint is sent its settings in its provider's spelling; one it has no field for
    # would run on the server's defaults, and table 8 would not hold: refused, not dropped
    roles = [("user", "--user-sim-provider", "--user-sim-thinking none", "--user-sim-top-k 0",
              s.user.provider or "openai", s.user.top_k, s.user.enable_thinking)]
    if endpoint:
        roles.append(("model", "--provider", "--thinking none", "--top-k 0", s.model.provider or "openai",
                      s.model.top_k, s.model.enable_thinking))
    for who, provider_flag, thinking_off, top_k_off, provider, top_k, thinking in roles:
        if who == "user" and not (s.user.model or s.user.base_url):
            continue
        if provider not in PROVIDERS:
            out.append(f"{provider_flag}={provider!r}; expected one of {sorted(PROVIDERS)}")
            continue
        for setting in unsendable(provider, top_k=top_k, thinking=thinking):
            value, off = (top_k, top_k_off) if setting == "top_k" else (thinking, thinking_off)
            out.append(refusal(provider, setting, value, key=f"the {'evaluated model' if who == 'model' else 'user'}'s "
                               f"{setting}", off=off, provider_key=provider_flag))
    return out


# what may change between the runs that fill one output directory: which tasks and how many
# trials (a resumed evaluation may add benchmarks or trials); how each episode is played may not
_MAY_CHANGE = ("benchmarks", "trials", "bfcl_trials")
# settings added after settings.json was first written, with the value every run had before
_BEFORE_RECORDED = {"tau2_prompts": "actionopd"}


def check_same_settings(out_dir: Path, settings: EvalSettings, *, has_episodes: bool) -> str:
    """Write settings.json; refuse to add episodes to a directory whose episodes were played
    under other settings (their scores could not be pooled). Returns a note for the user when
    the directory's earlier episodes have no recorded settings (written before they were)."""
    path = out_dir / "settings.json"
    mine = settings.record()
    note = ""
    if path.is_file():
        # JSON round-trips the record as it was written (benchmarks, a list, may change anyway)
        theirs, now = flatten(json.loads(path.read_text())), flatten(json.loads(json.dumps(mine)))
        for key, value in _BEFORE_RECORDED.items():
            theirs.setdefault(key, value)
        changed = sorted(k for k in theirs.keys() | now.keys()
                         if not k.startswith(_MAY_CHANGE) and theirs.get(k) != now.get(k))
        if changed and has_episodes:
            raise ValueError(f"{out_dir} holds episodes played under other settings ({', '.join(changed)} differ; "
                             f"see {path}): give another --out, or the same settings to resume")
    elif has_episodes:
        note = (f"note: {out_dir} holds episodes from before settings were recorded; their settings are unknown, "
                "the new ones are in settings.json")
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(mine, indent=2) + "\n")
    return note

