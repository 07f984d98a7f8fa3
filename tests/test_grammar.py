"""Grammars (edgekv/runtime/grammar_*.py) and the constrained decode loop: whatever the model's
logits, a reply that ends by "stop" is in the grammar's language, with jsonschema (and re) as the
oracles; schema features the engine cannot enforce and grammars past the limits are errors that
name them; `edgekv generate --json-schema | --grammar | --regex` through the real CLI."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="structured output needs llguidance (the serve extra)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is the oracle (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.runtime.grammar_build import MAX_GRAMMAR_CHARS, json_object, json_schema, lark, regex  # noqa: E402
from edgekv.runtime.grammar_constraint import compile_grammar  # noqa: E402
from edgekv.runtime.grammar_engine import Grammar, GrammarError  # noqa: E402
from edgekv.runtime.grammar_tokenizer import tokenizer_for  # noqa: E402
from edgekv.runtime.sampling import SamplingParams  # noqa: E402
from tests.conftest import cli, run_constrained, run_edgekv  # noqa: E402



@pytest.fixture(scope="module")
def rt(rt_int8):
    return rt_int8  # conftest's tiny int8 runtime


@pytest.fixture(scope="module")
def tok(rt):
    return tokenizer_for(rt.bundle)


def constrained(rt, tok, grammar: Grammar, seed: int, max_new: int = 200, prompt: str = "Answer:", stats=None):
    """(text, stop reason, the constraint) of a sampled reply under `grammar` on the tiny model, as
    `edgekv generate` decodes it (a one-request run of the batcher); `stats`, if given, gets the
    reply's stats."""
    ids, st, c = run_constrained(rt, compile_grammar(tok, grammar), rt.codec.encode(prompt), max_new,
                                 SamplingParams(temperature=1.0, seed=seed), rt.codec.stop_ids | set(tok.stop_ids))
    if stats is not None:
        vars(stats).update(vars(st))
    return rt.codec.decode(ids), st.stop_reason, c


# -- the property: every schema's replies validate -----------------------------------------------

# RFC 3339 section 5.6 (the formats' definition in JSON Schema), "T" and "Z" in either case as its
# note allows: jsonschema checks date-time only with an extra package, and its time checker
# refuses a lowercase "z"
TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))"
FULL_TIME, DATE_TIME = re.compile(TIME), re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt]" + TIME)


def rfc3339_time(m, at: int = 1) -> bool:
    h, mi, sec = (int(m.group(i)) for i in range(at, at + 3))
    off = m.group(at + 5)
    return h <= 23 and mi <= 59 and sec <= 60 and (off is None or (int(off) <= 23 and int(m.group(at + 6)) <= 59))


def rfc3339_date_time(s) -> bool:
    m = isinstance(s, str) and DATE_TIME.fullmatch(s)
    return bool(m) and 1 <= int(m.group(2)) <= 12 and 1 <= int(m.group(3)) <= 31 and rfc3339_time(m, 4)


def rfc3339_full_time(s) -> bool:
    m = isinstance(s, str) and FULL_TIME.fullmatch(s)
    return bool(m) and rfc3339_time(m)


FORMATS = jsonschema.FormatChecker()
FORMATS.checks("date-time")(rfc3339_date_time)
FORMATS.checks("time")(rfc3339_full_time)


def validate(value, schema) -> None:
    jsonschema.validate(value, schema, format_checker=FORMATS)


# Bounded schemas: every string has a maxLength, every array a maxItems, every number a range, no
# additional properties; so a random model's reply ends well within max_new (a whole reply is
# asserted, not only a valid prefix). Formats: those the engine and the oracle both know.
names = st.from_regex(r"[a-z]{1,6}", fullmatch=True)
scalars = st.one_of(st.text(max_size=4), st.integers(-50, 50), st.booleans(), st.none())
leaves = st.one_of(
    st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
    st.tuples(st.integers(-1000, 1000), st.integers(0, 2000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.tuples(st.integers(0, 3), st.integers(0, 6)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}),
    st.sampled_from(["date", "time", "date-time", "uuid", "ipv4"]).map(lambda f: {"type": "string", "format": f}),
    st.sampled_from([r"^[a-z]{1,4}$", r"^[0-9]{3}-[0-9]{2}$", r"^(yes|no)$"]).map(
        lambda p: {"type": "string", "pattern": p}),
    st.lists(scalars, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
    scalars.map(lambda v: {"const": v}),
)


def obj(props: dict, required: list[bool]) -> dict:
    keys = list(props)
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [k for k, r in zip(keys, required) if r]}


schemas = st.recursive(leaves, lambda kids: st.one_of(
    st.tuples(kids, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
    st.tuples(st.dictionaries(names, kids, min_size=1, max_size=3), st.lists(st.booleans(), min_size=3, max_size=3))
    .map(lambda t: obj(*t)),
    st.lists(kids, min_size=2, max_size=2).map(lambda alts: {"anyOf": alts}),
), max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**32 - 1))
def test_every_reply_validates_against_its_schema(rt, tok, schema, seed):
    text, reason, c = constrained(rt, tok, json_schema(schema), seed)
    assert reason == "stop", f"{reason}: {text!r}"
    validate(json.loads(text), schema)
    assert c.masks >= 1


def test_json_object_is_any_object(rt, tok):
    for seed in range(5):
        text, reason, _ = constrained(rt, tok, json_object(), seed, max_new=40)
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by length: always a prefix the grammar was still extending
            assert reason == "length" and text.startswith("{")


def test_regex_and_lark(rt, tok):
    for seed in range(6):
        text, reason, _ = constrained(rt, tok, regex(r"(yes|no), [0-9]{2,4}!"), seed)
        assert reason == "stop" and re.fullmatch(r"(yes|no), [0-9]{2,4}!", text), text
    spec = 'start: "(" item ("," item){0,3} ")"\nitem: NUM | WORD\nNUM: /[0-9]{1,3}/\nWORD: /[a-z]{1,5}/'
    for seed in range(6):
        text, reason, _ = constrained(rt, tok, lark(spec), seed)
        assert reason == "stop" and re.fullmatch(r"\((?:[0-9]{1,3}|[a-z]{1,5})(?:,(?:[0-9]{1,3}|[a-z]{1,5})){0,3}\)",
                                                 text), text


def test_a_whole_reply_ends_without_a_stop_token(rt, tok):
    """The grammar complete (only a stop token may follow): the loop ends there, reason stop."""
    from edgekv.runtime.stats import Stats

    st = Stats()
    text, reason, c = constrained(rt, tok, regex("abc"), 0, stats=st)
    assert (text, reason) == ("abc", "stop") and c.is_done()
    assert st.decode_steps == st.new_tokens - 1  # the first token from the prefill; no step for a stop token


def test_cut_by_length_says_so(rt, tok):
    text, reason, c = constrained(rt, tok, regex("[a-z]{50}"), 0, max_new=5)
    assert reason == "length" and not c.is_accepting()


# -- the mask: what allowed() says, and the constraint's contract ---------------------------------

@pytest.fixture(scope="module")
def real_tok(real_bundle_int4):
    """SmolLM2's own tokenizer (the bundle conftest exports once per run: CI tests these too)."""
    return tokenizer_for(load_bundle(real_bundle_int4))


def test_allowed_is_the_matcher_bitmask_and_both_stop_ids_end_a_reply(real_tok):
    """On SmolLM2's 49,152-token tokenizer: the bool mask is llguidance's own bitmask unpacked
    (its reference numpy helper as the oracle), and at the end both stop ids are allowed."""
    import llguidance
    import llguidance.numpy as lln

    tok = real_tok
    assert tok.stop_ids == (0, 2)
    grammar = json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    c, ref = compile_grammar(tok, grammar), llguidance.LLMatcher(tok.ll, grammar.text, log_level=0)
    for t in tok.ll.tokenize_str('{"a": 42}'):
        bits = lln.allocate_token_bitmask(1, tok.vocab_size)
        lln.fill_next_token_bitmask(ref, bits)
        logits = np.zeros((1, tok.vocab_size), np.float32)
        lln.apply_token_bitmask_inplace(logits, bits)
        assert np.array_equal(c.allowed(), np.isfinite(logits[0]))
        c.accept(t)
        assert ref.consume_token(t)
    assert set(np.flatnonzero(c.allowed()).tolist()) == {0, 2} and c.is_done()


def test_accept_refuses_a_token_the_mask_forbids_and_rollback_takes_tokens_back(real_tok):
    tok = real_tok
    c = compile_grammar(tok, regex("[0-9]+"))
    ok = c.allowed()
    bad = int(np.flatnonzero(~ok)[0])
    with pytest.raises(ValueError):
        c.accept(bad)
    seven = tok.ll.tokenize_str("7")[0]
    before = c.allowed().copy()
    c.accept(seven)
    assert c.is_accepting()
    c.rollback(1)
    assert not c.is_accepting() and np.array_equal(c.allowed(), before)


def test_the_tokenizer_is_built_once_per_bundle(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    assert tokenizer_for(b) is tokenizer_for(load_bundle(tiny_bundle_int8))


# -- what cannot be enforced is an error that names it ---------------------------------------------

@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "uri-reference"}, "uri-reference"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"$ref": "http://example.com/schema.json"}, "example.com"),
])
def test_unsupported_schema_features_are_named(schema, named, real_tok):
    with pytest.raises(GrammarError, match=re.escape(named)):
        compile_grammar(real_tok, json_schema(schema))


def test_annotations_and_pydantic_schemas_compile(real_tok):
    """Keywords that constrain nothing (titles, descriptions, $defs, examples) are no error."""
    schema = {"$defs": {"Step": {"properties": {"n": {"title": "N", "type": "integer"}}, "required": ["n"],
                                 "title": "Step", "type": "object", "additionalProperties": False}},
              "properties": {"steps": {"items": {"$ref": "#/$defs/Step"}, "title": "Steps", "type": "array"}},
              "required": ["steps"], "title": "Plan", "type": "object", "additionalProperties": False,
              "description": "d", "examples": [{"steps": []}]}
    compile_grammar(real_tok, json_schema(schema))


def test_grammars_past_the_limits_are_refused():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    with pytest.raises(GrammarError, match="characters, more than"):
        json_schema(big)
    deep = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError, match="nests deeper"):
        json_schema(deep)
    with pytest.raises(GrammarError, match="characters, more than"):
        regex("a" * (MAX_GRAMMAR_CHARS + 1))
    with pytest.raises(GrammarError, match="characters, more than"):
        lark("start: " + '"a" ' * MAX_GRAMMAR_CHARS)


def test_malformed_grammars_are_one_line_errors(real_tok):
    tok = real_tok
    for grammar, said in ((regex("(ab"), "regex"), (lark("start: foo"), "foo"), (lark("start: ("), "lark")):
        with pytest.raises(GrammarError, match=said) as e:
            compile_grammar(tok, grammar)
        assert "\n" not in str(e.value)


# -- the CLI ------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["city", "n"], "additionalProperties": False}


def test_generate_json_schema_regex_and_grammar(tiny_bundle_int8, tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(SCHEMA))
    (tmp_path / "g.lark").write_text('start: "ok " /[0-9]{2}/')
    for flag, value, check in (("--json-schema", tmp_path / "s.json", lambda t: validate(json.loads(t), SCHEMA)),
                               ("--regex", "(red|blue) [a-z]{3}", lambda t: re.fullmatch("(red|blue) [a-z]{3}", t)),
                               ("--grammar", tmp_path / "g.lark", lambda t: re.fullmatch("ok [0-9]{2}", t))):
        r = run_edgekv("generate", tiny_bundle_int8, "Say it", flag, value, "--temperature", "1", "--seed", "3",
                       "--max-new-tokens", "120", "--json", "--threads", "1")
        assert r.returncode == 0, r.stderr
        rec = json.loads(r.stdout)
        assert rec["stop_reason"] == "stop" and rec["constraint"]["complete"] and rec["constraint"]["masks"] >= 1
        assert check(rec["text"]) is not False, rec["text"]


def test_generate_cut_by_length_exits_non_zero_and_says_so(tiny_bundle_int8):
    r = run_edgekv("generate", tiny_bundle_int8, "Say it", "--regex", "[a-z]{40}", "--max-new-tokens", "3",
                   "--threads", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "ended by length before the regex was complete" in r.stderr


def test_generate_grammar_errors_are_one_line(tiny_bundle_int8, tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "not.json").write_text(json.dumps({"not": {"type": "string"}}))
    (tmp_path / "latin1.lark").write_bytes(b"start: \"\xe9\"")
    os.mkfifo(tmp_path / "fifo")
    # in this process (conftest's cli: no new Python per case), but for the fifo: a check that let
    # it through would block on reading it, which only a child's timeout ends
    def child(*args):
        return run_edgekv(*args, timeout=120)

    cases = [(cli, ["--json-schema", tmp_path / "missing.json"], "no such file"),
             (cli, ["--json-schema", tmp_path / "bad.json"], "not JSON"),
             (cli, ["--json-schema", tmp_path / "not.json"], 'Unimplemented keys: ["not"]'),
             (cli, ["--json-schema", tmp_path], "not a regular file"),
             (child, ["--grammar", tmp_path / "fifo"], "not a regular file"),
             (cli, ["--grammar", tmp_path / "latin1.lark"], "not UTF-8"),
             (cli, ["--regex", "(?=x)y"], "look-around")]
    for run, args, said in cases:
        r = run("generate", tiny_bundle_int8, "hi", *args, "--threads", "1")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and said in lines[0], (args, r.stderr)
    r = cli("generate", tiny_bundle_int8, "hi", "--regex", "a", "--grammar", tmp_path / "g.lark")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr


@pytest.mark.slow
def test_the_real_models_replies_validate(real_bundle_int4):
    """SmolLM2-135M (int4 weights) under three schemas, greedy with generate's repeat guard."""
    from edgekv.runtime.assemble import open_runtime

    asks = [("Describe a fictional person as JSON.",
             {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer", "minimum": 0},
                                               "hobbies": {"type": "array", "items": {"type": "string"},
                                                           "maxItems": 3}},
              "required": ["name", "age", "hobbies"], "additionalProperties": False}),
            ("Is Paris in France? Answer as JSON.",
             {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "why": {"type": "string", "maxLength": 80}},
              "required": ["answer", "why"], "additionalProperties": False}),
            ("When did the Apollo 11 landing happen? Answer as JSON.",
             {"type": "object", "properties": {"date": {"type": "string", "format": "date"}}, "required": ["date"],
              "additionalProperties": False})]
    with open_runtime(real_bundle_int4, ctx=512, backend="ort-cpu", threads=2) as rt:
        tok = tokenizer_for(rt.bundle)
        for prompt, schema in asks:
            ids, st, _ = run_constrained(rt, compile_grammar(tok, json_schema(schema)),
                                         rt.codec.chat_ids([{"role": "user", "content": prompt}]), 160,
                                         SamplingParams(repeat_penalty=1.1), rt.codec.stop_ids)
            assert st.stop_reason == "stop", rt.codec.decode(ids)
            validate(json.loads(rt.codec.decode(ids)), schema)


def test_a_schemas_own_lenient_option_is_overridden_and_warnings_are_errors(real_tok):
    """Two guards, each tested alone: json_schema() keeps llguidance strict whatever the schema's
    x-guidance says (llguidance's own validation then reports an error, not a warning), and a
    grammar that compiles only with warnings (something left unenforced) is refused."""
    import llguidance

    tok = real_tok
    lenient = {"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True}
    is_error, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(json_schema(lenient).text, tok.ll)
    assert is_error and "uniqueItems" in msgs[0]
    warned = Grammar("json_schema", llguidance.LLMatcher.grammar_from_json_schema(lenient))
    with pytest.raises(GrammarError, match="uniqueItems"):
        compile_grammar(tok, warned)


# -- the masks off the critical path (issue 26 item 5) --------------------------------------------

class Watched:
    """A constraint that records on which threads its masks were made."""

    def __init__(self, inner):
        self.inner, self.threads = inner, set()

    def allowed(self):
        import threading

        if self.inner._ok is None:  # a mask made now (else the one of this state, made before)
            self.threads.add(threading.current_thread().name)
        return self.inner.allowed()

    def accept(self, token):
        self.inner.accept(token)

    def is_done(self):
        return self.inner.is_done()


def batched_replies(rt, tok, overlap: bool, grammars, seeds):
    """Replies of requests decoded together (grammar None: free), with the masks made ahead (on
    the mask worker, while the graph runs) or when each row is sampled; the watched constraints."""
    from edgekv.runtime.batching import Request

    bt = rt.batcher(capacity=256, parallel=4, max_queue=8, prefill_chunk=32)
    bt.post.overlap_masks = overlap
    watched = [None if gr is None else Watched(compile_grammar(tok, gr)) for gr in grammars]
    reqs = [Request(rt.codec.encode("Answer:"), 40, SamplingParams(temperature=1.0, seed=s),
                    rt.codec.stop_ids | set(tok.stop_ids), constraint=w) for w, s in zip(watched, seeds)]
    for r in reqs:
        bt.submit(r)
    while bt.step():
        pass
    bt.post.close()
    return [r.out for r in reqs], watched


def test_masks_are_made_ahead_on_the_worker_and_change_no_token(rt, tok):
    """Four constrained requests and a free one (five: one waits for a slot): with the masks made
    ahead, every mask is made on the mask worker (the stepping thread makes none: it only joins);
    the tokens equal those of masks made when each row is sampled, and each request's alone."""
    grammars = [json_schema(SCHEMA), regex("(red|blue) [a-z]{3,9}"), None, json_object(),
                json_schema({"type": "array", "items": {"type": "boolean"}, "maxItems": 4})]
    seeds = [1, 2, 3, 4, 5]
    ahead, watched = batched_replies(rt, tok, True, grammars, seeds)
    assert all(w.threads == {"edgekv-masks_0"} for w in watched if w), [w and w.threads for w in watched]
    when_sampled, watched = batched_replies(rt, tok, False, grammars, seeds)
    assert all(w.threads == {"MainThread"} for w in watched if w)
    assert ahead == when_sampled and all(ahead)
    for i in range(len(grammars)):
        assert batched_replies(rt, tok, True, grammars[i:i + 1], seeds[i:i + 1])[0][0] == ahead[i]
