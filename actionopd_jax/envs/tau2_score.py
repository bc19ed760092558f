"""The tau2 reward of one episode, computed by the package's evaluators.

Same combination as the package's `evaluate_simulation` in its "all" mode, with
natural-language assertions switched off (the paper disables them everywhere): the reward is
the product of the environment check (DB hash match and/or env assertions), the expected-action
check and the communicate check, each included only if the task's reward basis names it.
Episodes that did not end by a user or agent stop score 0, as in the package.
"""

from __future__ import annotations

from typing import Any

from actionopd_jax.envs.tau2_tasks import environment_constructor, gc_paused

_GRADED_TERMINATIONS = ("user_stop", "agent_stop")


def score_tau2(domain: str, task: Any, trajectory: list[Any], termination: str | None) -> dict[str, Any]:
    from tau2.data_model.tasks import RewardType
    from tau2.evaluator.evaluator_action import ActionEvaluator
    from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
    from tau2.evaluator.evaluator_env import EnvironmentEvaluator

    out: dict[str, Any] = {"termination": termination or "running"}
    if termination not in _GRADED_TERMINATIONS:
        out.update(reward=0.0, note=f"episode ended by {termination or 'nothing yet'}; not graded")
        return out
    criteria = task.evaluation_criteria
    if criteria is None:
        out.update(reward=1.0, note="task has no evaluation criteria")
        return out
    basis = {RewardType(b) for b in criteria.reward_basis}
    try:
        # two fresh DBs replayed, dumped and hashed: allocation bursts with nothing to collect
        with gc_paused():
            env_info = EnvironmentEvaluator.calculate_reward(
                environment_constructor=environment_constructor(domain), task=task, full_trajectory=trajectory, solo_mode=False
            )
        action_info = ActionEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
        communicate_info = CommunicateEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
    except Exception as exc:  # e.g. replay mismatch: report, never crash the collector
        out.update(reward=0.0, error=f"{type(exc).__name__}: {exc}"[:500])
        return out
    reward, breakdown = 1.0, {}
    if basis & {RewardType.DB, RewardType.ENV_ASSERTION}:
        reward *= env_info.reward
        breakdown.update({k.value: v for k, v in (env_info.reward_breakdown or {}).items()})
    if RewardType.ACTION in basis:
        reward *= action_info.reward
        breakdown["ACTION"] = action_info.reward
    if RewardType.COMMUNICATE in basis:
        reward *= communicate_info.reward
        breakdown["COMMUNICATE"] = communicate_info.reward
    out.update(
        reward=float(reward),
        reward_basis=sorted(b.value for b in basis),
        breakdown=breakdown,
        db_match=env_info.db_check.db_match if env_info.db_check else None,
        env_assertions=[c.met for c in env_info.env_assertions or []],
        actions_matched=[c.action_match for c in action_info.action_checks or []],
        communicated=[c.met for c in communicate_info.communicate_checks or []],
        nl_assertions="off",
    )
    return out
