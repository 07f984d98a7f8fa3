"""`response_format` -> grammar (edgekv/serve/structured.py): what each type admits and refuses on
SmolLM2's real tokenizer (token by token, as the decode loop drives it), the openai client's
pydantic schema, and every malformed or unenforceable format as a 400-style error naming it."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance", reason="structured output needs llguidance (the serve extra)")

from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.runtime.grammar_tokenizer import tokenizer_for  # noqa: E402
from edgekv.serve.api import ApiError  # noqa: E402
from edgekv.serve.structured import compile_for_request, response_format_grammar  # noqa: E402



@pytest.fixture(scope="module")
def tok(real_bundle_int4):
    """SmolLM2's own tokenizer (the bundle conftest exports once per run: CI tests these too)."""
    return tokenizer_for(load_bundle(real_bundle_int4))


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
    with pytest.raises(ApiError, match=said) as e:
        response_format_grammar(rf)
    assert e.value.param == "response_format"


@pytest.mark.parametrize("schema, said", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "uri-reference"}, "uri-reference"),
    ({"not": {"type": "null"}}, "not"),
])
def test_unenforceable_schemas_are_400s_naming_the_feature(tok, schema, said):
    gr = response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(ApiError, match=said) as e:
        compile_for_request(tok, gr, "response_format")
    assert e.value.param == "response_format"


def test_an_oversized_schema_is_a_400():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    with pytest.raises(ApiError, match="more than") as e:
        response_format_grammar({"type": "json_schema", "json_schema": {"name": "big", "schema": big}})
    assert e.value.param == "response_format"


# -- logprobs fields ---------------------------------------------------------------------------------

def test_logprobs_asked():
    from edgekv.serve.structured import logprobs_asked

    assert logprobs_asked({}, chat=True) is None and logprobs_asked({"logprobs": False}, chat=True) is None
    assert logprobs_asked({"logprobs": True}, chat=True) == 0
    assert logprobs_asked({"logprobs": True, "top_logprobs": 20}, chat=True) == 20
    assert logprobs_asked({"logprobs": 3}, chat=False) == 3 and logprobs_asked({}, chat=False) is None
    for body, chat, param in (({"logprobs": 1}, True, "logprobs"), ({"top_logprobs": 2}, True, "top_logprobs"),
                              ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
                              ({"logprobs": True, "top_logprobs": True}, True, "top_logprobs"),
                              ({"logprobs": 6}, False, "logprobs"), ({"logprobs": True}, False, "logprobs")):
        with pytest.raises(ApiError) as e:
            logprobs_asked(body, chat)
        assert e.value.param == param


def test_logprobs_fields_in_openais_shape(tok):
    """Each token's bytes are its own (a UTF-8 character split over tokens: its bytes, joined,
    are the character), the logprobs those sampling computed."""
    from edgekv.runtime.sampling import TokenLogprob
    from edgekv.serve.structured import chat_logprobs, completion_logprobs

    ids = tok.ll.tokenize_str("café 🙂")
    entries = [TokenLogprob(t, -0.5 * k, [(t, -0.5 * k), (ids[0], -9.0)]) for k, t in enumerate(ids)]
    token_bytes = lambda t: tok.ll.decode_bytes([t])  # noqa: E731
    chat = chat_logprobs(entries, token_bytes)
    assert bytes(b for e in chat["content"] for b in e["bytes"]).decode() == "café 🙂"
    assert [e["logprob"] for e in chat["content"]] == [e.logprob for e in entries]
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] and len(e["top_logprobs"]) == 2 for e in chat["content"])
    comp = completion_logprobs(entries, token_bytes, text_offset=3)
    assert comp["text_offset"][0] == 3 and comp["token_logprobs"] == [e.logprob for e in entries]
    assert len(comp["tokens"]) == len(comp["top_logprobs"]) == len(ids)
