"""Unavailable supervision (paper A.3) and truncated replies, through the whole collector: our
loopback server is teacher and judge (real HTTP, real `openai` client), the judge fails some
replies on purpose, the student's N replies are fixed texts, so every number is hand-computed.

- A judge reply outside the verdict format is asked again, at most matcher.format_retries
  times (2 here): 2 bad replies then a verdict is that verdict; 3 bad replies are unavailable.
- A pair whose judge endpoint keeps failing (HTTP 500 after its transport retries) is
  unavailable too.
- An unavailable pair masks its group (no reward, never trained on) but does not end the
  trajectory: the commit follows the semantic reward of the known matches.
- A reply cut at the response limit is Invalid (-1), even when its text parses to an action.

Rewards (eq. 6, K=3, lambda=0.5): invalid -1, valid no match 0, c=1 -> 1.0, c=2 -> 1.25, c=3 -> 1.5.
"""

import numpy as np
import pytest

from actionopd_jax.sampling import Generation
from actionopd_jax.serve.scripted import ScriptedBackend, message_choice
from actionopd_jax.types import Invalid, ToolCall
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (A, B, BAD, FINAL, Script, case_of, collect_once, collector_config,
                                     make_collector, make_matcher, make_teacher, serve, student_text,
                                     teacher_backend, toy_task)

FLAKY_B = ToolCall("note", {"text": "FLAKY five"})      # the judge's first 2 replies are malformed, then MATCH
BROKEN_B = ToolCall("note", {"text": "BROKEN five"})    # the judge never gives a verdict
APIFAIL_B = ToolCall("note", {"text": "APIFAIL five"})  # the judge endpoint answers HTTP 500
TRUNC_THINK = "<think>\nI need to add 2 and 3, and then"  # cut inside its reasoning
TRUNC_CALL = ("truncated", A)                          # a complete call for A, but cut at the limit
FINAL_STATE = ([FINAL] * 3, [FINAL] * 4)

SCRIPT = Script(
    teacher={("flaky", 0): [B, B, A], ("masked", 0): [A, A, B], ("api", 0): [B, B, B], ("trunc", 0): [A, A, B],
             **{(c, 1): FINAL_STATE[0] for c in ("flaky", "masked", "api", "trunc")}},
    student={("flaky", 0): [FLAKY_B, B, A, BAD], ("masked", 0): [BROKEN_B, A, B, BAD],
             ("api", 0): [APIFAIL_B, B, B, B], ("trunc", 0): [A, TRUNC_THINK, TRUNC_CALL, B],
             **{(c, 1): FINAL_STATE[1] for c in ("flaky", "masked", "api", "trunc")}},
)
CASES = ["flaky", "masked", "api", "trunc"]


def judge_backend():
    """MATCH for same-name calls the student wrote with SAME / FLAKY (after two malformed
    replies to FLAKY), never a verdict for BROKEN, a backend error (HTTP 500) for APIFAIL."""
    flaky = {"n": 0}

    def reply(req):
        call_a = req.messages[-1]["content"].split("## Call A", 1)[-1].split("## Call B", 1)[0]
        if "APIFAIL" in call_a:
            raise RuntimeError("judge backend down")
        if "BROKEN" in call_a:
            return message_choice("They look alike to me.")
        if "FLAKY" in call_a:
            flaky["n"] += 1
            return message_choice("VERDICT: MATCH" if flaky["n"] > 2 else "Probably the same.\nVERDICT: match")
        return message_choice("VERDICT: NO_MATCH")

    return ScriptedBackend("judge", reply)


def sample_fn(tokenizer, eos_id):
    """The fixed student replies of SCRIPT; a TRUNC_* reply comes back cut at the limit
    (finish_reason "length", no end token), as the sampler reports it."""

    def run(prompts, keys):
        out = []
        for ids in prompts:
            text = tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)
            key = (case_of(text), text.count("<|im_start|>assistant") - 1)
            gens = []
            for action in SCRIPT.student[key]:
                if action is TRUNC_CALL or action is TRUNC_THINK:
                    body = student_text(A) if action is TRUNC_CALL else TRUNC_THINK
                    toks, finish = tokenizer.encode(body, add_special_tokens=False), "length"
                else:
                    toks, finish = tokenizer.encode(student_text(action), add_special_tokens=False) + [eos_id], "stop"
                gens.append(Generation(np.asarray(toks, np.int32), np.full(len(toks), -0.5, np.float32), finish))
            out.append(gens)
        return out

    return run


@pytest.fixture(scope="module")
def run(tiny_tokenizer):
    cfg = collector_config()
    judge = judge_backend()
    with serve(teacher_backend(SCRIPT), judge) as server:
        teacher, matcher = make_teacher(server), make_matcher(server, format_retries=2)
        eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
        collector = make_collector(cfg, tiny_tokenizer, teacher, matcher, sample_fn(tiny_tokenizer, eos))
        result = collect_once(collector, [toy_task(c, c) for c in CASES], step=0, process_index=0, process_count=1)
    groups = {}
    for g in result.groups:
        groups.setdefault(g.task_id, []).append(g)
    return result, groups, {r.task_id: r for r in result.trajectories}, judge


def rewards(g):
    return [c.reward for c in g.candidates]


def test_a_malformed_judge_reply_is_retried_and_its_verdict_used(run):
    _, groups, _, judge = run
    g = groups["flaky"][0]
    # FLAKY_B vs B: 2 malformed replies, then MATCH (one judgement serves both B samples)
    assert [c.verdicts for c in g.candidates][0] == ["match", "match", "no_match"]
    assert rewards(g) == [1.25, 1.25, 1.0, -1.0] and g.retained
    flaky_requests = [r for r in judge.requests if "FLAKY" in r.messages[-1]["content"]]
    assert len(flaky_requests) == 3


def test_unavailable_masks_the_group_and_the_trajectory_goes_on(run):
    _, groups, trajs, judge = run
    g = groups["masked"][0]
    assert g.candidates[0].verdicts == ["no_match", "no_match", "unavailable"]  # BROKEN_B vs A, A, B
    assert not g.retained and g.drop_reason == "unavailable" and rewards(g) == [0.0] * 4
    # commit by the known matches: [0, 1.25 (A: c=2), 1.0 (B: c=1), -1] -> candidate 1, then the episode goes on
    assert g.committed_index == 1
    assert len(groups["masked"]) == 2 and trajs["masked"].end_reason == "env_done"
    assert trajs["masked"].decisions == 2 and trajs["masked"].score["reward"] == 1.0
    assert len([r for r in judge.requests if "BROKEN" in r.messages[-1]["content"]]) == 3  # 1 + 2 retries
    # the judge endpoint down: all three pairs unavailable; the commit is one of the three B's
    api = groups["api"][0]
    assert api.candidates[0].verdicts == ["unavailable"] * 3 and api.drop_reason == "unavailable"
    assert api.committed_index in (1, 2, 3) and trajs["api"].end_reason == "env_done"
    assert len([r for r in judge.requests if "APIFAIL" in r.messages[-1]["content"]]) == 4  # transport attempts


def test_a_reply_cut_at_the_response_limit_is_invalid(run):
    _, groups, _, _ = run
    g = groups["trunc"][0]
    assert isinstance(g.candidates[1].action, Invalid) and isinstance(g.candidates[2].action, Invalid)
    assert g.candidates[2].text.startswith("<tool_call>")  # it would parse to A, yet it is no action
    assert rewards(g) == [1.25, -1.0, -1.0, 1.0] and g.retained and g.committed_index == 0


def test_step_metrics_report_unavailable_and_truncated_rates(run):
    result, _, _, _ = run
    m = result.metrics.as_dict()
    # 8 groups (2 per task start), 2 masked as unavailable; 96 verdicts, 1 + 3 unavailable
    assert m["collect/unavailable_group_rate"] == pytest.approx(2 / 8)
    assert m["collect/unavailable_pair_rate"] == pytest.approx(4 / 96)
    assert m["collect/verdicts/unavailable"] == 4
    assert m["collect/dropped/unavailable"] == 2
    assert m["collect/matcher/unavailable_format"] == 1 and m["collect/matcher/unavailable_api"] == 1
    assert m["collect/matcher/judge_format_retries"] == 2 + 2  # FLAKY: 2, BROKEN: 2
    assert m["collect/truncated_candidates"] == 2 and m["collect/truncated_in_reasoning"] == 1
    # invalid: flaky 1 + masked 1 + trunc 2 of 32 candidates
    assert m["collect/invalid_rate"] == pytest.approx(4 / 32)
    assert m["collect/ended/env_done"] == 4
