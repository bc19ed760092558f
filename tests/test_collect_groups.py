"""Hand-built state groups through the whole collector: our loopback server as teacher and
judge (real HTTP, real `openai` client), the real Matcher, a small real environment, and a
student whose N replies are fixed texts (so every reward and commit is computed by hand).

Reward rule (paper eq. 6, K = 3, lambda = 0.5): invalid -1; valid without a match 0; c > 0
matches: 1 + 0.5 * (c - 1) / 2, i.e. c=1 -> 1.0, c=2 -> 1.25, c=3 -> 1.5.
"""

import dataclasses

import jax
import numpy as np
import pytest

from actionopd_jax.collect import NO_COMMIT, CollectorConfig, commit_index, local_task_starts
from actionopd_jax.collect import keys as collect_keys
from actionopd_jax.rewards import RewardConfig
from actionopd_jax.types import Invalid, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (A, B, BAD, C, FINAL, collect_once, Script, collector_config, fixed_text_sample_fn,
                                     judge_backend, make_collector, make_matcher, make_teacher, serve,
                                     teacher_backend, toy_task)

SAME_B = ToolCall("note", {"text": "SAME five"})        # judge says MATCH against B
BROKEN = ToolCall("note", {"text": "BROKEN five"})      # judge answers without a verdict
A_REORDERED = ToolCall("add", {"b": 3, "a": 2})        # canonical match with A (key order)

FINAL_STATE = ([FINAL] * 3, [FINAL] * 4)  # every candidate matches 3 times: equal rewards, episode ends

SCRIPT = Script(
    teacher={("paper", 0): [A, A, B], ("paper", 1): FINAL_STATE[0],
             ("ties", 0): [A, B, B], ("ties", 1): FINAL_STATE[0],
             ("allinvalid", 0): [A, A, A], ("allinvalid", 1): FINAL_STATE[0],
             ("partial", 0): [A, A, BAD], ("partial", 1): FINAL_STATE[0],
             ("judge", 0): [B, B, A], ("judge", 1): FINAL_STATE[0],
             ("broken", 0): [A, A, B], ("broken", 1): [B, B, B], ("broken", 2): FINAL_STATE[0],
             ("nosup", 0): [BAD, BAD, BAD],
             ("envfail", 0): [A, A, B],
             **{("limit", d): [A, A, B] for d in range(6)},
             ("hang", 0): [A, A, B]},
    student={("paper", 0): [A, B, C, BAD], ("paper", 1): FINAL_STATE[1],
             ("ties", 0): [A, A_REORDERED, C, BAD], ("ties", 1): FINAL_STATE[1],
             ("allinvalid", 0): [BAD] * 4, ("allinvalid", 1): FINAL_STATE[1],
             ("partial", 0): [A, B, C, BAD], ("partial", 1): FINAL_STATE[1],
             ("judge", 0): [SAME_B, B, A, BAD], ("judge", 1): FINAL_STATE[1],
             ("broken", 0): [A, A, B, BAD], ("broken", 1): [BROKEN, B, B, B], ("broken", 2): FINAL_STATE[1],
             ("nosup", 0): [A, A, A, A],
             ("envfail", 0): [A, B, C, BAD],
             **{("limit", d): [A, A, C, BAD] for d in range(6)},
             ("hang", 0): [A, B, C, BAD]},
)

CASES = ["paper", "ties", "allinvalid", "partial", "judge", "broken", "nosup", "envfail", "limit", "overflow", "hang"]


def _tasks():
    extra = {"envfail": {"fail_at": 1}, "hang": {"hang_at": 1}}
    tasks = [toy_task(case, case, **extra.get(case, {})) for case in CASES]
    i = CASES.index("overflow")  # a question far longer than the context budget
    tasks[i] = toy_task("overflow", "overflow", question="case=overflow " + "seven " * 2000)
    return tasks


def _collect(tokenizer, cfg, tasks, step=3):
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:
        teacher, matcher = make_teacher(server), make_matcher(server)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        collector = make_collector(cfg, tokenizer, teacher, matcher, fixed_text_sample_fn(tokenizer, SCRIPT, eos))
        return collect_once(collector, tasks, step=step, process_index=0, process_count=1)


def _by_case(result):
    out = {}
    for g in result.groups:
        out.setdefault(g.task_id, []).append(g)
    return out, {r.task_id: r for r in result.trajectories}


@pytest.fixture(scope="module")
def actionopd_run(tiny_tokenizer):
    cfg = collector_config(env_timeout_s=1.0)
    return cfg, _collect(tiny_tokenizer, cfg, _tasks())


def _rewards(g):
    return [c.reward for c in g.candidates]


def test_paper_example_rewards_and_unique_argmax_commit(actionopd_run):
    cfg, result = actionopd_run
    groups, trajs = _by_case(result)
    g = groups["paper"][0]
    assert _rewards(g) == [1.25, 1.0, 0.0, -1.0]
    assert [c.verdicts for c in g.candidates] == [["match", "match", "no_match"], ["no_match", "no_match", "match"],
                                                 ["no_match"] * 3, ["no_match"] * 3]
    assert g.retained and g.drop_reason == "" and g.committed_index == 0
    assert isinstance(g.candidates[3].action, Invalid)
    assert [s.action for s in g.teacher_samples] == [A, A, B]
    # the last state: all four candidates match all three samples -> 1.5 each -> dropped, still committed
    last = groups["paper"][1]
    assert _rewards(last) == [1.5] * 4 and not last.retained and last.drop_reason == "equal_rewards"
    assert last.committed_index in range(4)
    assert trajs["paper"].end_reason == "env_done" and trajs["paper"].score["reward"] == 1.0


def test_ties_are_broken_among_the_best_only(actionopd_run):
    # which of the tied candidates is drawn, and that the draw is uniform, is checked over many
    # task starts in test_variants (independent of the key formula)
    _, result = actionopd_run
    groups, _ = _by_case(result)
    g = groups["ties"][0]
    assert _rewards(g) == [1.0, 1.0, 0.0, -1.0]  # A and its key-reordered copy each match once
    assert g.committed_index in (0, 1)
    g2 = groups["judge"][0]  # judge MATCH for SAME_B: two candidates tie at 1.25
    assert _rewards(g2) == [1.25, 1.25, 1.0, -1.0] and g2.committed_index in (0, 1)


def test_all_invalid_group_is_dropped_but_the_trajectory_goes_on(actionopd_run):
    _, result = actionopd_run
    groups, trajs = _by_case(result)
    g = groups["allinvalid"][0]
    assert _rewards(g) == [-1.0] * 4 and not g.retained and g.drop_reason == "equal_rewards"
    assert all(isinstance(c.action, Invalid) for c in g.candidates)
    assert g.committed_index in range(4)
    assert len(groups["allinvalid"]) == 2 and trajs["allinvalid"].end_reason == "env_done"


def test_partial_teacher_multiset_keeps_k_in_the_denominator(actionopd_run):
    _, result = actionopd_run
    groups, _ = _by_case(result)
    g = groups["partial"][0]
    assert [s.action for s in g.teacher_samples] == [A, A]  # third slot invalid after 2 regenerations
    assert _rewards(g) == [1.25, 0.0, 0.0, -1.0]          # c=2 of nominal K=3: 1 + 0.5*(2-1)/(3-1)
    assert all(len(c.verdicts) == 2 for c in g.candidates)
    assert g.retained and g.committed_index == 0


def test_judge_failure_masks_that_group_and_the_trajectory_goes_on(actionopd_run):
    _, result = actionopd_run
    groups, trajs = _by_case(result)
    first, second, third = groups["broken"]
    assert first.retained and _rewards(first) == [1.25, 1.25, 1.0, -1.0]
    assert not second.retained and second.drop_reason == "unavailable" and _rewards(second) == [0.0] * 4
    assert second.candidates[0].verdicts == ["unavailable"] * 3
    # committed by the known matches: BROKEN 0, each B 1.5 (c=3): one of the B's, then the episode ends
    assert second.committed_index in (1, 2, 3) and second.committed_index != NO_COMMIT
    assert third.drop_reason == "equal_rewards"
    assert trajs["broken"].end_reason == "env_done" and trajs["broken"].decisions == 3


def test_no_teacher_sample_means_no_group_and_the_trajectory_ends(actionopd_run):
    _, result = actionopd_run
    groups, trajs = _by_case(result)
    assert "nosup" not in groups
    assert trajs["nosup"].end_reason == "no_supervision" and trajs["nosup"].decisions == 1
    assert trajs["nosup"].score["reward"] == 0.0  # scored as what happened, not a failure label


def test_environment_failures_end_only_their_trajectory(actionopd_run):
    _, result = actionopd_run
    groups, trajs = _by_case(result)
    assert trajs["envfail"].end_reason == "env_error" and len(groups["envfail"]) == 1
    assert groups["envfail"][0].retained
    assert trajs["hang"].end_reason == "env_timeout" and len(groups["hang"]) == 1
    assert trajs["overflow"].end_reason == "context_overflow" and trajs["overflow"].decisions == 0
    assert "overflow" not in groups


def test_decision_limit_and_result_order(actionopd_run):
    cfg, result = actionopd_run
    groups, trajs = _by_case(result)
    assert cfg.decision_limit("toy") == 4
    assert len(groups["limit"]) == 4 and trajs["limit"].end_reason == "decision_limit"
    keys = [(s, g.decision_index) for s, g in zip(result.group_starts, result.groups)]
    assert keys == sorted(keys)
    assert [r.task_start for r in result.trajectories] == list(range(len(CASES)))


def test_step_metrics(actionopd_run):
    _, result = actionopd_run
    m = result.metrics
    kept = sum(g.retained for g in result.groups)
    assert m.groups_kept == kept
    assert m.groups_dropped["equal_rewards"] == 7  # 6 final states + allinvalid
    assert m.groups_dropped["unavailable"] == 1 and m.groups_dropped["no_supervision"] == 1
    assert m.trajectory_ends["env_done"] == 6  # paper, ties, allinvalid, partial, judge, broken
    assert m.candidates == 4 * len(result.groups)
    assert m.invalid_rate == pytest.approx(m.invalid_candidates / m.candidates)
    assert 0 < m.match_rate <= 1
    assert m.reward_hist["1.25"] >= 3 and m.reward_hist["-1"] >= 4
    assert m.teacher.http_calls > 0 and m.matcher["judge_calls"] >= 2
    logged = m.as_dict()
    assert logged["collect/dropped/unavailable"] == 1 and "collect/sampler_busy_fraction" in logged


STARTS = 24  # task starts of the "ties" state per variant: enough to see every allowed commit


def _commit_counts(groups, n=4):
    return np.bincount([g.committed_index for g in groups], minlength=n).tolist()


@pytest.mark.parametrize("variant", ["actionopd", "validity", "binary", "random_commit"])
def test_variants(tiny_tokenizer, variant):
    """Rewards by hand, and the commit rule seen from outside: over STARTS task starts of the
    "ties" state (semantic rewards [1, 1, 0, -1]) the argmax variants commit candidates 0 and 1
    only, each often (uniform tie-break: 12 of 24 expected, sd 2.4); random commit draws all
    four, the zero-reward and the invalid one included (6 of 24 expected, sd 2.1). The bounds
    are 3+ sd wide; the keys are seeded, so the counts are the same on every run."""
    cfg = collector_config().with_variant(variant)
    tasks = [toy_task(case, case) for case in ("paper", "ties", "judge")]
    tasks += [toy_task(f"ties{i}", "ties") for i in range(STARTS)]
    result = _collect(tiny_tokenizer, cfg, tasks)
    groups, _ = _by_case(result)
    paper, judge = groups["paper"][0], groups["judge"][0]
    many = [groups[f"ties{i}"][0] for i in range(STARTS)]
    semantic = {"paper": [1.25, 1.0, 0.0, -1.0], "judge": [1.25, 1.25, 1.0, -1.0]}
    counts = _commit_counts(many)
    if variant in ("actionopd", "validity"):
        # validity trains on +1 valid / -1 invalid but commits on the semantic reward (paper B.4)
        want = [1.0, 1.0, 1.0, -1.0] if variant == "validity" else semantic["paper"]
        assert _rewards(paper) == want and paper.committed_index == 0
        assert judge.committed_index in (0, 1)
    elif variant == "binary":
        assert _rewards(paper) == [1.0, 1.0, 0.0, -1.0] and paper.committed_index in (0, 1)
        assert _rewards(judge) == [1.0, 1.0, 1.0, -1.0] and judge.committed_index in (0, 1, 2)
    if variant == "random_commit":
        assert _rewards(paper) == semantic["paper"]
        assert all(1 <= c <= 13 for c in counts), counts
    else:
        assert counts[2] == counts[3] == 0 and all(4 <= c <= 20 for c in counts[:2]), counts


def test_commit_index_tie_break_is_uniform_over_the_maximum_only():
    rewards = np.array([1.0, 0.0, 1.0, -1.0, 1.0])
    picks = [commit_index(rewards, collect_keys.commit_key(7, 0, s, 0), "argmax") for s in range(600)]
    counts = np.bincount(picks, minlength=5)
    assert counts[1] == counts[3] == 0
    assert all(150 <= counts[i] <= 250 for i in (0, 2, 4)), counts  # ~200 each (binomial sd ~ 11.5)
    picks = [commit_index(rewards, collect_keys.commit_key(7, 0, s, 0), "random") for s in range(500)]
    counts = np.bincount(picks, minlength=5)
    assert all(60 <= c <= 140 for c in counts), counts
    assert commit_index(np.array([0.0, 1.25, 1.0]), jax.random.key(0), "argmax") == 1


def test_keys_depend_on_position_only():
    k = collect_keys.student_key(5, 2, 9, 3)
    assert np.array_equal(jax.random.key_data(k), jax.random.key_data(collect_keys.student_key(5, 2, 9, 3)))
    variants = [collect_keys.student_key(6, 2, 9, 3), collect_keys.student_key(5, 3, 9, 3),
                collect_keys.student_key(5, 2, 8, 3), collect_keys.student_key(5, 2, 9, 4),
                collect_keys.commit_key(5, 2, 9, 3)]
    datas = {tuple(np.asarray(jax.random.key_data(x)).tolist()) for x in [k, *variants]}
    assert len(datas) == 6
    with pytest.raises(ValueError, match="task_start"):
        collect_keys.state_key(0, 0, -1, 0)


def test_local_task_starts_partition_the_step():
    shares = [local_task_starts(10, p, 3) for p in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(sum(shares, [])) == list(range(10))
    with pytest.raises(ValueError):
        local_task_starts(10, 3, 3)


def test_config_errors_name_the_problem():
    sampling = dict(max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=0, enable_thinking=False)
    with pytest.raises(ValueError, match="seed"):
        CollectorConfig(seed=-1, **sampling)
    with pytest.raises(ValueError, match="commit"):
        CollectorConfig(seed=0, commit="best", **sampling)
    with pytest.raises(ValueError, match="variant"):
        CollectorConfig(seed=0, **sampling).with_variant("greedy")
    # the sampling settings have no defaults of their own (config/schema.py is their one source)
    with pytest.raises(TypeError, match="temperature"):
        CollectorConfig(seed=0, max_new_tokens=16, top_p=1.0, top_k=0, enable_thinking=False)
    cfg = CollectorConfig(seed=0, **sampling)
    assert cfg.decision_limit("tau2_airline") == 20 and cfg.decision_limit("bfcl") is None
    assert cfg.decision_limit("awm") == 40
    assert dataclasses.replace(cfg, reward=RewardConfig(k=5)).k == 5


def test_prompt_budget_drops_oldest_exchanges_and_keeps_the_protected_part(tiny_tokenizer):
    from actionopd_jax.collect import PromptBuilder
    from tests._collect_fixtures import TOOLS

    msgs = [{"role": "system", "content": "You are a careful arithmetic assistant."},
            {"role": "user", "content": "case=budget Add many numbers."}]
    for i in range(12):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": f'{{"a": {i}, "b": {i}}}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "name": "add", "content": str(2 * i)})
    builder = PromptBuilder(tiny_tokenizer, max_prompt_tokens=10_000, enable_thinking=False)
    full = builder.build(msgs, TOOLS)
    assert full.dropped_messages == 0 and full.messages == msgs
    budget = full.ids.size - 60
    tight = PromptBuilder(tiny_tokenizer, max_prompt_tokens=budget, enable_thinking=False).build(msgs, TOOLS)
    assert 0 < tight.dropped_messages and tight.ids.size <= budget
    assert tight.messages[:2] == msgs[:2] and tight.messages[-2:] == msgs[-2:]  # system, task, latest exchange
    np.testing.assert_array_equal(tight.ids, builder.render(tight.messages, TOOLS))
    protected_only = builder.render(msgs[:2] + msgs[-2:], TOOLS).size
    assert PromptBuilder(tiny_tokenizer, max_prompt_tokens=protected_only - 1,
                         enable_thinking=False).build(msgs, TOOLS) is None


def test_sequential_baseline_produces_the_same_groups(tiny_tokenizer, actionopd_run):
    """The naive loop (teacher, then student, then matcher) shares every rule and key with
    the async collector, so on the same task starts it records the same groups."""
    from actionopd_jax.collect.naive import run_sequential
    from tests._collect_fixtures import group_signature

    cfg, result = actionopd_run
    wanted = ["paper", "ties", "allinvalid", "partial", "judge", "broken", "nosup", "limit", "overflow"]
    tasks = _tasks()
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:
        eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
        collector = make_collector(cfg, tiny_tokenizer, make_teacher(server), make_matcher(server),
                                   fixed_text_sample_fn(tiny_tokenizer, SCRIPT, eos))
        import asyncio

        from actionopd_jax.collect.naive import collect_sequential
        starts = [(CASES.index(c), tasks[CASES.index(c)]) for c in wanted]
        naive = asyncio.run(collect_sequential(collector, starts, step=3))
    keep = {CASES.index(c) for c in wanted}
    async_sig = [s for s in group_signature(result) if s[0] in keep]
    assert group_signature(naive) == async_sig
    assert naive.metrics.sampler_states == naive.metrics.sampler_calls  # one state per device call
    assert {r.task_id: r.end_reason for r in naive.trajectories} == \
           {r.task_id: r.end_reason for r in result.trajectories if r.task_id in wanted}
    assert run_sequential  # the sync wrapper exists for the benchmark


def test_a_failed_device_call_stops_the_collection_with_its_error(tiny_tokenizer):
    """A sampler failure is systemic (not one trajectory's problem): collect raises it
    promptly instead of recording empty trajectories or hanging."""

    from actionopd_jax.collect import SamplerError

    def broken(prompts, keys):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of device memory (injected)")

    cfg = collector_config()
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:   # a hang: the suite's timeout
        collector = make_collector(cfg, tiny_tokenizer, make_teacher(server), make_matcher(server), broken)
        with pytest.raises(SamplerError, match="out of device memory"):
            collect_once(collector, [toy_task(c, c) for c in ("paper", "ties", "judge")], step=0,
                         process_index=0, process_count=1)


def test_closing_the_collector_closes_its_http_clients_on_its_loop(tiny_tokenizer):
    """The teacher's and the judge's AsyncOpenAI clients are closed on the collector's loop
    before the loop closes; closed with the loop, their own clean-up later ran on a closed loop
    ("Event loop is closed" on stderr)."""
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:
        teacher, matcher = make_teacher(server), make_matcher(server)
        eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
        collector = make_collector(collector_config(), tiny_tokenizer, teacher, matcher,
                                   fixed_text_sample_fn(tiny_tokenizer, SCRIPT, eos))
        collector.collect([toy_task("judge", "judge")], step=0, process_index=0, process_count=1)
        clients = [teacher.inner.endpoint._loop_resources[1], matcher.judge.endpoint._loop_resources[1]]
        assert not any(c.is_closed() for c in clients)
        collector.close()
    assert all(c.is_closed() for c in clients)
    assert teacher.inner.endpoint._loop_resources is None and matcher.judge.endpoint._loop_resources is None
