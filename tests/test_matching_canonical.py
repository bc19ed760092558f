"""Programmatic matching rules: canonical argument comparison and normalized message match."""

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from actionopd_jax.matching.canonical import (
    canonical_json,
    compare_tool_calls,
    differing_paths,
    values_equal,
)
from actionopd_jax.matching.messages import messages_equal, normalize_message
from actionopd_jax.types import ToolCall

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=64), st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=5), children, max_size=4)),
    max_leaves=20,
)


def _shuffle_keys(v, rng):
    if isinstance(v, dict):
        items = list(v.items())
        rng.shuffle(items)
        return {k: _shuffle_keys(x, rng) for k, x in items}
    if isinstance(v, list):
        return [_shuffle_keys(x, rng) for x in v]
    return v


@settings(max_examples=200, deadline=None)
@given(json_values, st.integers(0, 2**32 - 1))
def test_key_order_invariance(value, seed):
    shuffled = _shuffle_keys(value, random.Random(seed))
    assert values_equal(value, shuffled)
    assert canonical_json(value) == canonical_json(shuffled)


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_equality_is_reflexive_and_agrees_with_canonical_text(value):
    assert differing_paths(value, value) == []
    # json round trip (floats stay floats, ints stay ints) keeps equality
    assert values_equal(value, json.loads(json.dumps(value)))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=5), json_scalars, max_size=4), st.text(max_size=5), st.booleans())
def test_bool_is_never_a_number(base, key, flag):
    a = {**base, key: flag}
    b = {**base, key: int(flag)}
    c = {**base, key: float(flag)}
    assert not values_equal(a, b) and not values_equal(a, c)
    assert differing_paths(a, b) == [differing_paths({key: 0}, {key: True})[0]]
    assert canonical_json(a) != canonical_json(b)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=5), json_scalars, max_size=4), st.text(max_size=5))
def test_null_is_not_missing(base, key):
    with_null = {**base, key: None}
    without = {k: v for k, v in base.items() if k != key}
    assert not values_equal(with_null, without)
    assert canonical_json(with_null) != canonical_json(without)


@settings(max_examples=200, deadline=None)
@given(st.lists(json_scalars, min_size=2, max_size=6))
def test_list_order_and_multiplicity_kept(items):
    reordered = list(reversed(items))
    assert values_equal(items, reordered) == (canonical_json(items) == canonical_json(reordered))
    if any(not values_equal(x, y) for x, y in zip(items, reordered)):
        assert not values_equal(items, reordered)
    assert not values_equal(items, items + items[:1])  # multiplicity counts


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**9, 10**9))
def test_integral_floats_normalized(n):
    assert values_equal({"x": n}, {"x": float(n)})
    assert canonical_json([n]) == canonical_json([float(n)])
    assert not values_equal({"x": n}, {"x": n + 0.5})


def test_hand_picked_cases_and_paths():
    assert values_equal({"city": "Paris", "unit": "celsius"}, {"unit": "celsius", "city": "Paris"})
    assert values_equal({"a": -0.0}, {"a": 0})
    assert not values_equal({"a": True}, {"a": 1})
    assert not values_equal({"a": False}, {"a": 0.0})
    assert not values_equal({"a": None}, {})
    assert not values_equal({"a": "1"}, {"a": 1})
    assert values_equal({"a": float("nan")}, {"a": float("nan")})  # identical calls must match
    assert differing_paths(
        {"q": {"ids": [1, 2, 3], "name": "x"}, "flag": True, "only_a": 1, "odd key": 1},
        {"q": {"ids": [1, 5], "name": "x"}, "flag": 1, "odd key": 2},
    ) == ["$.flag", '$["odd key"]', "$.only_a", "$.q.ids[1]", "$.q.ids[2]"]
    assert differing_paths({"a": [1]}, {"a": {"0": 1}}) == ["$.a"]


def test_compare_tool_calls_requires_same_name():
    same = compare_tool_calls(ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Paris"}))
    assert same.same_name and same.equal and same.paths == ()
    other = compare_tool_calls(ToolCall("get_weather", {}), ToolCall("Get_Weather", {}))
    assert not other.same_name and not other.equal
    diff = compare_tool_calls(ToolCall("f", {"a": 1, "b": 2}), ToolCall("f", {"a": 1, "b": 3}))
    assert diff.same_name and not diff.equal and diff.paths == ("$.b",)


def test_deep_nesting_is_safe():
    deep_a, deep_b = 0, 1
    for _ in range(500):
        deep_a, deep_b = [deep_a], [deep_b]
    assert not values_equal(deep_a, deep_b)
    assert values_equal(deep_a, json.loads(json.dumps(deep_a)))
    assert canonical_json(deep_a) != canonical_json(deep_b)


def test_message_normalization_rule():
    assert normalize_message("  Hello,   WORLD!! ") == "hello world"
    assert messages_equal("Your booking is confirmed.", "your booking is confirmed")
    assert messages_equal("ＡＢＣ", "abc")  # NFKC full-width
    # punctuation touching digits is kept: numbers carry facts
    assert not messages_equal("It costs $3.50", "It costs $350")
    assert not messages_equal("Set it to -5", "Set it to 5")
    assert not messages_equal("1,000 miles", "1000 miles")
    # symbols are not punctuation
    assert not messages_equal("50% off", "50 off")
    # different words never become equal
    assert not messages_equal("Changes are not permitted", "Changes are permitted")
