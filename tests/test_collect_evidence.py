"""The collector hands the task's environment to the matcher, so required tool evidence applies
during collection: a state whose candidates need the judge for a tool without evidence has no
supervision (the group is masked; the trajectory goes on), and with the evidence the judge decides
(real HTTP teacher and judge on 127.0.0.1, the toy environment)."""

from actionopd_jax.matching.judge import JudgeConfig, LLMJudge
from actionopd_jax.matching.matcher import Matcher
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (A, BAD, C, FAST_RETRY, Script, collect_once, collector_config,
                                     fixed_text_sample_fn, judge_backend, make_collector, make_teacher, serve,
                                     teacher_backend, toy_task)

SCRIPT = Script(teacher={}, student={("ev", d): [A, C, C, BAD] for d in range(4)})  # C: add, other arguments


def _matcher(server, evidence: dict[str, str]) -> Matcher:
    judge = LLMJudge(JudgeConfig(model="judge", base_url=server.base_url, provider="vllm", api_key_env=None,
                                 request_timeout_s=2.0, retry=FAST_RETRY))
    return Matcher(judge, evidence_by_env={"toy": evidence})


def _run(tokenizer, evidence):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    judge = judge_backend()
    with serve(teacher_backend(SCRIPT), judge) as server:
        matcher = _matcher(server, evidence)
        collector = make_collector(collector_config(decision_limits=(("toy", 2),)), tokenizer, make_teacher(server),
                                   matcher, fixed_text_sample_fn(tokenizer, SCRIPT, eos))
        result = collect_once(collector, [toy_task("e0", "ev")], step=0, process_index=0, process_count=1)
        collector.close()
    return result, matcher, judge


def test_missing_required_evidence_masks_the_state(tiny_tokenizer):
    result, matcher, judge = _run(tiny_tokenizer, {"note": "def note(text): ..."})  # nothing for `add`
    group = result.groups[0]
    assert not group.retained and group.drop_reason == "unavailable"
    # teacher samples [A, A, B]: C vs A needs the judge (no evidence for add); C vs B differs by name
    assert group.candidates[1].verdicts == ["unavailable", "unavailable", "no_match"]
    # known matches: A 1.25 (c=2), C 0, C 0, invalid -1 -> A is committed and the episode goes on
    assert group.committed_index == 0
    assert len(result.groups) == 2 and result.trajectories[0].end_reason == "decision_limit"
    assert matcher.stats.missing_evidence > 0 and len(judge.requests) == 0


def test_with_the_evidence_the_judge_decides(tiny_tokenizer):
    result, matcher, judge = _run(tiny_tokenizer, {"add": "def add(a, b):\n    return a + b  # ADD-EVIDENCE",
                                                   "note": "def note(text): ..."})
    group = result.groups[0]
    assert group.retained and group.candidates[1].verdicts[0] == "no_match"
    assert matcher.stats.missing_evidence == 0 and len(judge.requests) > 0
    assert "ADD-EVIDENCE" in judge.requests[0].messages[-1]["content"]
