"""`response_format` -> grammar (edgekv/serve/structured.py): what each type admits and refuses on
SmolLM2's real tokenizer (token by token, as the decode loop drives it), the openai client's
pydantic schema, and every malformed or unenforceable format as a 400-style error naming it."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance", reason="structured output needs llguidance (the serve extra)")

from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.runtime import grammar as g  # noqa: E402
from edgekv.serve.structured import BadRequest, compile_for_request, response_format_grammar  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

REAL = ROOT / "models" / "bundles" / "smollm2-135m-instruct-int8-wint4"


@pytest.fixture(scope="module")
def tok():
    if not REAL.is_dir():
        pytest.skip("the real default-model bundle is not here")
    return g.tokenizer_for(load_bundle(REAL))


def admits(tok, grammar, text: str) -> bool:
    """The text, tokenized as the model would write it, is a whole reply under the grammar."""
    c = compile_for_request(tok, grammar, "response_format")
    for t in tok.ll.tokenize_str(text):
        if not c.allowed()[t]:
            return False
        c.accept(t)
    return c.is_accepting()


def test_text_and_absent_are_unconstrained():
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None


def test_json_object_admits_objects_only(tok):
    gr = response_format_grammar({"type": "json_object"})
    assert admits(tok, gr, '{"a": [1, 2, {"b": null}], "c": "d"}')
    assert admits(tok, gr, "{}")
    for other in ("[1, 2]", '"text"', "42", '{"a": 1', "Sure! {}"):
        assert not admits(tok, gr, other), other


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "number"},
                                           "unit": {"enum": ["C", "F"]}},
          "required": ["city", "temp", "unit"], "additionalProperties": False}


@pytest.mark.parametrize("strict", [True, False, None])
def test_json_schema_is_enforced_strict_or_not(tok, strict):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": strict}}
    gr = response_format_grammar(rf)
    assert admits(tok, gr, '{"city": "Paris", "temp": 21.5, "unit": "C"}')
    for bad in ('{"city": "Paris", "temp": "warm", "unit": "C"}', '{"city": "Paris", "temp": 1, "unit": "K"}',
                '{"city": "Paris", "temp": 1}', '{"city": "Paris", "temp": 1, "unit": "C", "x": 1}'):
        assert not admits(tok, gr, bad), bad


def test_the_openai_clients_pydantic_schema(tok):
    """client.beta.chat.completions.parse(response_format=Model) sends the model's strict schema
    (openai's own conversion): it compiles, and the model's own JSON is a whole reply."""
    pydantic = pytest.importorskip("pydantic")
    to_strict = pytest.importorskip("openai.lib._pydantic").to_strict_json_schema

    class Step(pydantic.BaseModel):
        explanation: str
        output: str

    class Math(pydantic.BaseModel):
        steps: list[Step]
        final_answer: str
        confidence: float | None

    rf = {"type": "json_schema", "json_schema": {"name": "Math", "schema": to_strict(Math), "strict": True}}
    gr = response_format_grammar(rf)
    sample = Math(steps=[Step(explanation="add", output="2")], final_answer="2", confidence=None)
    assert admits(tok, gr, json.dumps(sample.model_dump()))
    assert not admits(tok, gr, json.dumps({"steps": [], "final_answer": 2, "confidence": None}))


@pytest.mark.parametrize("rf, said", [
    ({"type": "xml"}, "text, json_object or json_schema"),
    ("json", "text, json_object or json_schema"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": "{}"}}, "schema must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": "yes"}}, "strict must be"),
])
def test_malformed_formats_are_400s(rf, said):
    with pytest.raises(BadRequest, match=said) as e:
        response_format_grammar(rf)
    assert e.value.param == "response_format"


@pytest.mark.parametrize("schema, said", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "uri-reference"}, "uri-reference"),
    ({"not": {"type": "null"}}, "not"),
])
def test_unenforceable_schemas_are_400s_naming_the_feature(tok, schema, said):
    gr = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(BadRequest, match=said) as e:
        compile_for_request(tok, gr, "response_format")
    assert e.value.param == "response_format"


def test_an_oversized_schema_is_a_400():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    with pytest.raises(BadRequest, match="more than") as e:
        response_format_grammar({"type": "json_schema", "json_schema": {"name": "big", "schema": big}})
    assert e.value.param == "response_format"
