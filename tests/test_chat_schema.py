"""JSON-schema validation of tool arguments (the subset tool schemas use), including the real
tau2 tool schemas (pydantic-generated, with $defs/$ref/anyOf) against tau2's ground-truth
actions and the BFCL function docs (type aliases such as "dict" and "float")."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from actionopd_jax.chat.schema import SchemaError, json_equal, validate_arguments


def ok(args, schema):
    return validate_arguments(args, schema) is None


def obj(**props):
    return {"type": "object", "properties": props}


@pytest.mark.parametrize(
    "value, type_name, valid",
    [
        (3, "integer", True), (3.0, "integer", True), (3.5, "integer", False), (True, "integer", False),
        ("3", "integer", False), (3, "number", True), (2.5, "number", True), (False, "number", False),
        (True, "boolean", True), (0, "boolean", False), ("x", "string", True), (None, "string", False),
        (None, "null", True), ([1], "array", True), ({"a": 1}, "object", True), ([], "object", False),
        # BFCL function-doc aliases
        ({"a": 1}, "dict", True), (1.5, "float", True), (True, "float", False), ([1, 2], "tuple", True),
        ({"any": [None]}, "any", True), (7, "long", True),
    ],
)
def test_types(value, type_name, valid):
    assert ok({"v": value}, obj(v={"type": type_name})) is valid


def test_type_list_and_nullable():
    assert ok({"v": None}, obj(v={"type": ["string", "null"]}))
    assert not ok({"v": 1}, obj(v={"type": ["string", "null"]}))
    assert ok({"v": None}, obj(v={"type": "string", "nullable": True}))


def test_required_and_additional_properties():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
    assert ok({"a": "x"}, schema)
    assert validate_arguments({}, schema) == "arguments: missing required argument 'a'"
    assert validate_arguments({"a": "x", "b": 1}, schema) == "arguments: unexpected argument 'b' (allowed: a)"
    # default JSON-schema semantics: extra keys allowed unless additionalProperties says no
    assert ok({"a": "x", "b": 1}, {k: v for k, v in schema.items() if k != "additionalProperties"})
    typed_extra = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert ok({"x": 1, "y": 2}, typed_extra) and not ok({"x": "1"}, typed_extra)


def test_null_is_not_missing():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert validate_arguments({"a": None}, schema) == "arguments.a: expected string, got null None"


def test_enum_and_const_use_json_equality():
    assert ok({"u": "celsius"}, obj(u={"enum": ["celsius", "fahrenheit"]}))
    assert "is not one of" in validate_arguments({"u": "kelvin"}, obj(u={"enum": ["celsius", "fahrenheit"]}))
    assert ok({"n": 1.0}, obj(n={"enum": [1, 2]}))  # 1.0 == 1 in JSON
    assert not ok({"n": True}, obj(n={"enum": [1, 2]}))  # but true is not 1
    assert not ok({"n": 1}, obj(n={"const": True}))
    assert json_equal({"a": [1, {"b": None}]}, {"a": [1.0, {"b": None}]})
    assert not json_equal({"a": None}, {})


def test_nested_items_report_path():
    schema = obj(passengers={"type": "array", "items": obj(name={"type": "string"}, age={"type": "integer"})})
    assert ok({"passengers": [{"name": "A", "age": 3}]}, schema)
    assert validate_arguments({"passengers": [{"name": "A"}, {"name": "B", "age": "x"}]}, schema) == (
        "arguments.passengers[1].age: expected integer, got string 'x'"
    )


def test_positional_items_and_bounds():
    schema = obj(p={"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}], "items": False,
                    "minItems": 1})
    assert ok({"p": [1, "a"]}, schema)
    assert not ok({"p": [1, "a", 3]}, schema)  # items: false forbids extra positions
    assert not ok({"p": ["a"]}, schema)
    assert not ok({"p": []}, schema)
    bounded = obj(n={"type": "integer", "minimum": 1, "maximum": 7}, s={"type": "string", "maxLength": 3})
    assert ok({"n": 1, "s": "abc"}, bounded)
    assert validate_arguments({"n": 8}, bounded) == "arguments.n: must be <= 7, got 8"
    assert not ok({"n": 0}, bounded) and not ok({"s": "abcd"}, bounded)
    assert not ok({"n": 5}, obj(n={"type": "number", "exclusiveMaximum": 5}))
    assert not ok({"n": 5}, obj(n={"type": "number", "maximum": 5, "exclusiveMaximum": True}))  # draft-4 form


def test_combinators():
    optional_int = obj(v={"anyOf": [{"type": "integer"}, {"type": "null"}]})
    assert ok({"v": None}, optional_int) and ok({"v": 2}, optional_int)
    assert "anyOf" in validate_arguments({"v": "2"}, optional_int)
    one = obj(v={"oneOf": [{"type": "number"}, {"type": "integer"}]})
    assert ok({"v": 2.5}, one)
    assert "exactly one" in validate_arguments({"v": 2}, one)  # both branches match
    both = obj(v={"allOf": [{"type": "string"}, {"maxLength": 2}]})
    assert ok({"v": "ab"}, both) and not ok({"v": "abc"}, both)
    assert not ok({"v": 1}, obj(v={"not": {"type": "integer"}}))


def test_refs_and_boolean_schemas():
    schema = {
        "$defs": {"Pt": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/Pt"}, "anything": True, "nothing": False},
    }
    assert ok({"p": {"x": 1}, "anything": [None]}, schema)
    assert validate_arguments({"p": {}}, schema) == "arguments.p: missing required argument 'x'"
    assert validate_arguments({"nothing": 1}, schema) == "arguments.nothing: no value is allowed here"
    with pytest.raises(SchemaError, match="does not resolve"):
        validate_arguments({"p": {}}, {"properties": {"p": {"$ref": "#/$defs/Missing"}}})
    with pytest.raises(SchemaError, match="cycle"):
        validate_arguments({"a": 1}, {"$defs": {"L": {"$ref": "#/$defs/L"}}, "properties": {"a": {"$ref": "#/$defs/L"}}})


def test_arguments_must_be_object_and_missing_schema_allows_any():
    assert validate_arguments([1], {"type": "object"}) == "arguments: expected an object, got array [1]"
    assert validate_arguments({"x": 1}, None) is None


def _tau2_tools_and_actions(domain: str):
    module = __import__(f"tau2.domains.{domain}.environment", fromlist=["get_environment"])
    tools = {t.openai_schema["function"]["name"]: t.openai_schema["function"]["parameters"]
             for t in module.get_environment().get_tools()}
    tasks = json.loads(resources.files("tau2").joinpath(f"data/tau2/domains/{domain}/tasks.json").read_text())
    actions = [a for t in tasks for a in ((t.get("evaluation_criteria") or {}).get("actions") or [])]
    return tools, [a for a in actions if a["name"] in tools]


@pytest.mark.parametrize("domain", ["airline", "retail"])
def test_tau2_ground_truth_actions_validate(domain):
    tools, actions = _tau2_tools_and_actions(domain)
    assert len(actions) > 100
    for action in actions:
        assert validate_arguments(action["arguments"], tools[action["name"]]) is None, action
    # corrupted copies are caught (tau2 lets passengers/flights be free-form objects via anyOf,
    # so the checks here are on the typed top-level fields)
    if domain == "airline":
        booking = next(a for a in actions if a["name"] == "book_reservation")["arguments"]
        schema = tools["book_reservation"]
        assert validate_arguments({**booking, "cabin": "first"}, schema).startswith(
            "arguments.cabin: string 'first' is not one of ['business', 'economy', 'basic_economy']")
        assert validate_arguments({**booking, "total_baggages": "2"}, schema) == (
            "arguments.total_baggages: expected integer, got string '2'")
        assert validate_arguments({**booking, "passengers": {"first_name": "A"}}, schema).startswith(
            "arguments.passengers: expected array")
        missing = {k: v for k, v in booking.items() if k != "user_id"}
        assert validate_arguments(missing, schema) == "arguments: missing required argument 'user_id'"


def test_bfcl_function_docs_are_usable():
    docs = {}
    text = resources.files("bfcl_eval").joinpath("data/multi_turn_func_doc/gorilla_file_system.json").read_text()
    for line in text.splitlines():
        if line.strip():
            fn = json.loads(line)
            docs[fn["name"]] = fn["parameters"]
    assert ok({"folder": "document"}, docs["cd"])
    assert validate_arguments({"folder": 3}, docs["cd"]) == "arguments.folder: expected string, got integer 3"
    assert validate_arguments({}, docs["cd"]) == "arguments: missing required argument 'folder'"
