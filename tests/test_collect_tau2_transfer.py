"""tau2's transfer rule (paper B.4): a transfer notification without the preceding transfer call
is invalid output, reward -1. The rule on hand-built states, then through the whole collector
(our loopback teacher and judge over real HTTP, fixed student replies, a tau2 task name on the
small real environment), with the rewards computed by hand (K=3, lambda=0.5)."""

from actionopd_jax.envs.protocol import apply_protocol_rules
from actionopd_jax.types import Invalid, Message, ToolCall, Task
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (A, B, FINAL, Script, collect_once, collector_config, fixed_text_sample_fn,
                                     judge_backend, make_collector, make_matcher, make_teacher, serve,
                                     teacher_backend)

NOTIFY = Message("YOU ARE BEING TRANSFERRED TO A HUMAN AGENT. PLEASE HOLD ON.")
TRANSFER_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "transfer_to_human_agents", "arguments": "{}"}}]}
OTHER_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c0", "type": "function", "function": {"name": "get_user_details", "arguments": "{}"}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "Transfer successful"}
USER = {"role": "user", "content": "I want a human."}


def test_notification_is_valid_only_right_after_the_transfer_call():
    after_transfer = [USER, TRANSFER_CALL, TOOL_RESULT]
    assert apply_protocol_rules("tau2_airline", NOTIFY, after_transfer) == NOTIFY
    lower = Message("Ok, you are being   transferred to a human agent now.")
    assert apply_protocol_rules("tau2_retail", lower, after_transfer) == lower
    for state in ([USER], [USER, OTHER_CALL, TOOL_RESULT], [USER, TRANSFER_CALL, TOOL_RESULT,
                                                           {"role": "assistant", "content": "Anything else?"}, USER]):
        got = apply_protocol_rules("tau2_telecom", NOTIFY, state)
        assert isinstance(got, Invalid) and "transfer_to_human_agents" in got.reason
    # other messages, tool calls and other environments are untouched
    assert apply_protocol_rules("tau2_airline", FINAL, [USER]) == FINAL
    assert apply_protocol_rules("tau2_airline", A, [USER]) == A
    assert apply_protocol_rules("bfcl", NOTIFY, [USER]) == NOTIFY


SCRIPT = Script(teacher={("transfer", 0): [NOTIFY, NOTIFY, A], ("transfer", 1): [FINAL] * 3},
                student={("transfer", 0): [NOTIFY, A, B, FINAL], ("transfer", 1): [FINAL] * 4})


def test_the_collector_scores_a_premature_notification_minus_one(tiny_tokenizer):
    task = Task(task_id="transfer", env="tau2_airline",
                payload={"question": "case=transfer What is 2 + 3, then add 1?"})
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:
        collector = make_collector(collector_config(), tiny_tokenizer, make_teacher(server), make_matcher(server),
                                   fixed_text_sample_fn(tiny_tokenizer, SCRIPT, eos))
        result = collect_once(collector, [task], step=0, process_index=0, process_count=1)
    g = result.groups[0]
    assert isinstance(g.candidates[0].action, Invalid)
    # NOTIFY would match the teacher's two NOTIFY samples (1.25); without a transfer call it is -1.
    # A matches once (1.0); B and FINAL match nothing (the judge says NO_MATCH for FINAL vs NOTIFY).
    assert [c.reward for c in g.candidates] == [-1.0, 1.0, 0.0, 0.0]
    assert g.candidates[0].verdicts == ["no_match"] * 3 and g.retained and g.committed_index == 1
    assert result.metrics.invalid_candidates == 1
