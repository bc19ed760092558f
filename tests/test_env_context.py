"""Context budget: property tests (hypothesis) that the protected part is always kept, that
the oldest removable units go first and no more than needed, and that an over-budget protected
part ends the episode; plus hand-checked examples and a real chat-template token counter."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actionopd_jax.chat.context import fit_context, removable_units

TOOLS = [{"type": "function", "function": {"name": "ls", "description": "list", "parameters": {"type": "object", "properties": {}}}}]


def count_chars(messages, tools):
    """A monotone stand-in for a tokenizer: characters of the rendered JSON."""
    return len(json.dumps(messages)) + len(json.dumps(tools))


def _exchange(i, n_results=1):
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}_{k}", "type": "function", "function": {"name": "ls", "arguments": "{}"}} for k in range(n_results)]}
    return [call] + [{"role": "tool", "tool_call_id": f"c{i}_{k}", "content": f"result {i}.{k} " * 3} for k in range(n_results)]


@st.composite
def conversations(draw):
    messages = [{"role": "system", "content": "policy " * draw(st.integers(0, 5))}] if draw(st.booleans()) else []
    n_turns = draw(st.integers(1, 5))
    uid = 0
    for t in range(n_turns):
        messages.append({"role": "user", "content": f"request {t} " * draw(st.integers(1, 4))})
        for _ in range(draw(st.integers(0, 3))):
            uid += 1
            messages += _exchange(uid, draw(st.integers(1, 2)))
        last_turn = t == n_turns - 1
        if not last_turn or draw(st.booleans()):
            messages.append({"role": "assistant", "content": f"answer {t}"})
    return messages


def _is_subsequence(small, big):
    it = iter(big)
    return all(any(x is y for y in it) for x in small)


@settings(max_examples=300, deadline=None)
@given(conversations(), st.integers(50, 3000))
def test_fit_keeps_the_protected_part_and_drops_the_oldest_units_first(messages, budget):
    result = fit_context(messages, TOOLS, count_chars, budget)
    units = removable_units(messages)
    removable = {i for u in units for i in u}
    protected = [m for i, m in enumerate(messages) if i not in removable]
    # The protected part is always there, in order, and the result is a subsequence.
    assert _is_subsequence(protected, result.messages)
    assert _is_subsequence(result.messages, messages)
    # System messages, the first user message and the current turn's user message are protected.
    users = [m for m in messages if m["role"] == "user"]
    assert all(m in protected for m in messages if m["role"] == "system")
    assert users[0] in protected and users[-1] in protected and messages[-1] in protected
    # Exactly a prefix of the units (oldest first) was dropped.
    k = result.dropped_units
    gone = {i for u in units[:k] for i in u}
    assert result.messages == [m for i, m in enumerate(messages) if i not in gone]
    assert result.tokens == count_chars(result.messages, TOOLS)
    if result.fits:
        assert result.tokens <= budget
        if k > 0:  # minimal: keeping one more unit would not fit
            fewer = {i for u in units[: k - 1] for i in u}
            assert count_chars([m for i, m in enumerate(messages) if i not in fewer], TOOLS) > budget
    else:
        assert k == len(units) and count_chars(protected, TOOLS) > budget
    # Tool calls and their results are never separated.
    kept_ids = {c["id"] for m in result.messages for c in m.get("tool_calls") or []}
    assert {m["tool_call_id"] for m in result.messages if m["role"] == "tool"} <= kept_ids


def test_units_by_hand():
    m = [
        {"role": "system", "content": "S"},  # 0 protected
        {"role": "user", "content": "U1"},  # 1 protected (task)
        *_exchange(1),  # 2, 3  -> part of turn 1
        {"role": "assistant", "content": "A1"},  # 4
        {"role": "user", "content": "U2"},  # 5  -> turn 2, whole
        {"role": "assistant", "content": "A2"},  # 6
        {"role": "user", "content": "U3"},  # 7 protected (current turn)
        *_exchange(2, 2),  # 8, 9, 10 -> removable exchange
        *_exchange(3),  # 11, 12 -> protected (latest exchange)
    ]
    assert removable_units(m) == [[2, 3, 4], [5, 6], [8, 9, 10]]
    full = count_chars(m, TOOLS)
    keep_all = fit_context(m, TOOLS, count_chars, full)
    assert keep_all.fits and keep_all.dropped_units == 0 and keep_all.messages is m
    one_less = fit_context(m, TOOLS, count_chars, full - 1)
    assert one_less.fits and one_less.dropped_units == 1 and one_less.dropped_messages == 3
    assert [x["content"] for x in one_less.messages[:3]] == ["S", "U1", "U2"]
    protected_only = [m[i] for i in (0, 1, 7, 11, 12)]
    tight = fit_context(m, TOOLS, count_chars, count_chars(protected_only, TOOLS))
    assert tight.fits and tight.messages == protected_only
    over = fit_context(m, TOOLS, count_chars, count_chars(protected_only, TOOLS) - 1)
    assert not over.fits and over.messages == protected_only  # caller ends the episode
    with pytest.raises(ValueError, match="positive"):
        fit_context(m, TOOLS, count_chars, 0)


def test_tool_schemas_are_never_truncated():
    big_tools = TOOLS * 50
    m = [{"role": "user", "content": "U"}, *_exchange(1), *_exchange(2)]
    seen = []

    def count(messages, tools):
        seen.append(tools)
        return count_chars(messages, tools)

    result = fit_context(m, big_tools, count, count_chars(m[:1] + m[3:], big_tools))
    assert result.fits and result.dropped_units == 1
    assert all(t is big_tools for t in seen)


def test_with_the_project_chat_template_as_token_counter(tmp_path):
    """The counter can be any callable; here the project's own chat template and tokenizer
    (the tiny offline one), so tool schemas and tool-call markup are counted as rendered."""
    from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer, render_ids

    tok = load_tokenizer(build_tiny_tokenizer(tmp_path / "tok", vocab_size=512))

    def count(messages, tools):
        return len(render_ids(tok, messages, tools))

    m = [{"role": "system", "content": "policy"}, {"role": "user", "content": "request"}]
    m += [x for i in range(6) for x in _exchange(i)]
    full = count(m, TOOLS)
    result = fit_context(m, TOOLS, count, full - 5)
    assert result.fits and result.dropped_units == 1 and result.tokens <= full - 5
    assert result.messages[:2] == m[:2] and result.messages[-2:] == m[-2:]
    protected = count(m[:2] + m[-2:], TOOLS)
    assert fit_context(m, TOOLS, count, protected).messages == m[:2] + m[-2:]
    assert not fit_context(m, TOOLS, count, protected - 1).fits
