"""Which EnvScaler scenarios are conversational: played with our simulated user (envs/user_sim.py)
instead of as one-turn tasks.

What the published layout says (RUC-NLPIR/EnvScaler, read for this rule):
- A scenario record (`task_id`, `env_id`, `env_class_name`, `init_config`, `task`, `checklist`,
  `checklist_with_func`) has no field for the mode, and neither has the environment record.
  `env_class_name` names the *simulated system's* class, which both modes instantiate alike.
- The mode is the *harness* class a run picks: `EnvScalerConvRLEnv` (the user LLM opens from
  the task and ends with ###STOP###) or `EnvScalerNonConvRLEnv` (the task text is the first user
  turn; the agent's first text ends it). Both load the same file: the RL recipe's
  `SynEnvConversationTrain` and `SynEnvNonConversationTrain` entries differ only in `env_type`,
  and `interact_with_env/run_main.py` pairs `rl_scenario_metadata.json` and
  `sft_scenario_metadata.json` each with both harnesses. So neither the file (SFT / RL) nor the
  task text decides the mode; the same goal text is what the user simulator plays from.
- The ActionOPD paper's EnvScaler pool is the one with the simulated user (sec. 3.1: "EnvScaler
  adds a simulated user to the interaction loop"; table 8 gives its user simulator).

The rule, per scenario, first that applies:
1. the run's override, `env.envscaler_conversational` (our counterpart of upstream's harness
   choice): `all`, `none`, or a list of task ids (exactly those are conversational);
2. the record's own `"conversational": true | false` (our extension, docs/formats.md);
3. otherwise conversational, as the paper plays the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

ALL, NONE = "all", "none"

# why a scenario got its mode (the `--check` line counts them)
BY_OVERRIDE = "env.envscaler_conversational"
BY_MARK = "the record's own mark"
BY_DEFAULT = "the default (conversational)"


class UnknownScenarioIds(ValueError):
    """The override names task ids the directory does not hold."""

    def __init__(self, ids: list[str], where: str):
        self.ids = ids
        super().__init__(f"{len(ids)} task id(s) are not scenarios of {where}: {ids[:10]}"
                         + (" ..." if len(ids) > 10 else ""))


@dataclass(frozen=True)
class ConversationalRule:
    """The override: `kind` "data" (none given: each record's mark, else conversational), "all",
    "none" or "ids" (exactly `ids`)."""

    kind: str = "data"
    ids: frozenset[str] = frozenset()

    def decide(self, task_id: str, mark: bool | None) -> tuple[bool, str]:
        """(conversational, why) for one scenario; `mark`: the record's own field, None if absent."""
        if self.kind == ALL:
            return True, BY_OVERRIDE
        if self.kind == NONE:
            return False, BY_OVERRIDE
        if self.kind == "ids":
            return task_id in self.ids, BY_OVERRIDE
        if mark is not None:
            return mark, BY_MARK
        return True, BY_DEFAULT

    def unknown(self, task_ids: Iterable[str]) -> list[str]:
        return sorted(self.ids - set(task_ids))


def parse_rule(values: str | Iterable[str] | None) -> ConversationalRule:
    """`None` / `()` -> the data decides; `"all"` / `["all"]`, `"none"` / `["none"]`; a list of
    task ids. ValueError for `all` / `none` mixed with ids, or an empty id."""
    if values is None:
        return ConversationalRule()
    items = [values] if isinstance(values, str) else [str(v) for v in values]
    items = [v.strip() for v in items]
    if not items:
        return ConversationalRule()
    keywords = [v for v in items if v.lower() in (ALL, NONE)]
    if keywords:
        if len(items) != 1:
            raise ValueError(f"env.envscaler_conversational={items}: give `all`, `none`, or a list of task ids, "
                             "not a mix of them")
        return ConversationalRule(kind=keywords[0].lower())
    if any(not v for v in items):
        raise ValueError(f"env.envscaler_conversational={items}: an empty task id; list the ids of the scenarios "
                         "to play with the user simulator (their `task_id`), or give `all` / `none`")
    return ConversationalRule(kind="ids", ids=frozenset(items))


def record_mark(item: dict, where: str) -> bool | None:
    """A scenario record's own `conversational` field: True / False, None when absent;
    ValueError for anything else (a string "false" would otherwise read as true)."""
    if "conversational" not in item or item["conversational"] is None:
        return None
    value = item["conversational"]
    if not isinstance(value, bool):
        raise ValueError(f"{where}: `conversational` must be true or false (JSON booleans), got {value!r}; "
                         "fix the record or leave the field out (then the run's env.envscaler_conversational, "
                         "else conversational)")
    return value
