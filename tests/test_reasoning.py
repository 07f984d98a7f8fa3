"""The streamed reply's <think> part (edgekv/runtime/reasoning.py) against a regular expression on
the whole reply (the oracle), for every way of cutting the reply into pieces; and chat's printing
of it (--thinking show/hide)."""
from __future__ import annotations

import io
import random
import re

import pytest

from edgekv.runtime.reasoning import ReasoningSplitter, opens_reasoning, split_reply

REPLIES = [
    "<think>\nThe user greets.\n</think>\n\nHello! How can I help?",
    "  <think>a < b </thi and </th</think>answer <think> stays text",
    "<think>\n\n</think>\n\nNo thinking today.",
    "Just an answer, <think> mid-text is text.",
    "<thi",  # a reply that is only a start of the tag: its answer
    "<think>unfinished reasoning </thin",
    "\n\n",
    "<think>x</think>",
    "</think> a close with no open is text",
]


def oracle(text, in_reasoning=False):
    if in_reasoning:
        text = "<think>" + text
    m = re.match(r"\s*<think>(.*?)</think>\n*(.*)\Z", text, re.S)
    if m:
        return m.group(1), m.group(2)
    m = re.match(r"\s*<think>(.*)\Z", text, re.S)
    if m:
        return m.group(1), ""
    return "", "" if not text.strip() else text


def run(pieces, in_reasoning=False):
    s = ReasoningSplitter(in_reasoning)
    parts = [s.push(p) for p in pieces] + [s.flush()]
    return parts


@pytest.mark.parametrize("text", REPLIES)
def test_every_two_and_three_piece_cut_gives_the_whole_replys_split(text):
    want = oracle(text)
    cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1)]
    for i, j in cuts:
        parts = run([text[:i], text[i:j], text[j:]])
        got = ("".join(p.reasoning for p in parts), "".join(p.content for p in parts))
        assert got == want, (i, j)


def test_one_character_pieces_never_show_a_piece_of_a_tag():
    text = REPLIES[0]
    parts = run(list(text))
    shown = [p.reasoning for p in parts] + [p.content for p in parts]
    assert not any(re.search(r"</?t(h(i(n(k)?)?)?)?>?$", piece) or "<" in piece for piece in shown)
    assert ("".join(p.reasoning for p in parts), "".join(p.content for p in parts)) == oracle(text)


def test_random_pieces_and_a_prompt_that_opens_the_reasoning():
    rng = random.Random(0)
    for text in REPLIES:
        for in_r in (False, True):
            if in_r and text.lstrip().startswith("<think>"):
                continue
            cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            parts = run(pieces, in_r)
            got = ("".join(p.reasoning for p in parts), "".join(p.content for p in parts))
            assert got == oracle(text, in_r), (text, in_r, pieces)
            whole = split_reply(text, in_r)
            assert (whole.reasoning, whole.content) == got


def test_opens_reasoning():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_reasoning("<|im_start|>assistant\n")


@pytest.mark.parametrize("show", [True, False])
def test_chat_prints_the_reasoning_between_its_tags_or_not_at_all(show):
    from edgekv.chat.terminal import ReplyPrinter

    out = io.StringIO()  # not a terminal: the reasoning keeps its tags instead of dimming
    p = ReplyPrinter(out, show_reasoning=show)
    for ch in REPLIES[0]:
        p.write(ch)
    p.finish()
    answer = "Hello! How can I help?"
    assert out.getvalue() == ("<think>\nThe user greets.\n</think>\n" + answer if show else answer)


# -- serve: reasoning_content (issue 23: Qwen3's thinking mode in serve) ----------------------------

THOUGHT, ANSWER = "\nThe user greets: greet back.\n", "Hello! How can I help?"
SCRIPT = f"<think>{THOUGHT}</think>\n\n{ANSWER}"


@pytest.fixture(scope="module")
def thinking_rt(tiny_bundle_int8, tmp_path_factory):
    """The tiny bundle with Qwen3's template (tests/archs.py), whose model says SCRIPT: every row
    the backend returns gets the script's token for its position a large lead (greedy follows it)."""
    import json
    import shutil

    import numpy as np

    pytest.importorskip("starlette")
    from edgekv.runtime.assemble import open_runtime
    from tests.archs import TEMPLATES

    folder = tmp_path_factory.mktemp("thinking") / "b"
    shutil.copytree(tiny_bundle_int8, folder)
    man = json.loads((folder / "edgekv.json").read_text())
    (folder / "edgekv.json").write_text(json.dumps({**man, "chat_template": TEMPLATES["qwen3"]}))
    r = open_runtime(folder, ctx=256, backend="ort-cpu", threads=1)
    start = len(r.codec.chat_ids(MSGS))  # the first reply token's position (the default render)
    script = r.codec.encode(SCRIPT) + [min(r.codec.stop_ids)]
    real = r.backend.run_cells

    def run_cells(cache, past, write, ids, pos, mask, idx):
        out = real(cache, past, write, ids, pos, mask, idx).copy()
        for k, p in enumerate(pos[0, idx[0]]):
            j = int(p) + 1 - start
            if 0 <= j < len(script):
                out[0, k, script[j]] = out[0, k].max() + 100.0
        return out

    r.backend.run_cells = run_cells
    yield r
    r.close()


MSGS = [{"role": "user", "content": "Hi!"}]


def test_serve_splits_the_think_part_into_reasoning_content(thinking_rt):
    """The non-streamed message: reasoning_content the <think> part, content the answer (the
    splitter's oracle: the regular expression above on the whole reply); the streamed deltas'
    reasoning_content and content reassemble to exactly those."""
    import json

    import httpx

    from tests.serving import serving

    with serving(thinking_rt) as s:
        body = {"messages": MSGS, "max_tokens": 120, "temperature": 0}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == oracle(SCRIPT)
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as st:
            chunks = [json.loads(x[6:]) for x in st.iter_lines() if x.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
        assert sum(bool(d.get("reasoning_content")) for d in deltas) > 1  # streamed in pieces, not at the end
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_template_kwargs_enable_thinking_as_vllm_takes_it(thinking_rt):
    import httpx

    from tests.serving import serving

    with serving(thinking_rt) as s:
        def post(kw):
            return httpx.post(s.url + "/v1/chat/completions", timeout=120,
                              json={"messages": MSGS, "max_tokens": 1, "temperature": 0, "chat_template_kwargs": kw})

        on, off = post({"enable_thinking": True}).json(), post({"enable_thinking": False}).json()
        # the template pre-fills an empty <think></think> for enable_thinking false: the prompt grows
        want = len(thinking_rt.codec.chat_ids(MSGS, enable_thinking=False))
        assert off["usage"]["prompt_tokens"] == want > on["usage"]["prompt_tokens"]
        assert post(None).status_code == post({}).status_code == 200
        for kw, said in (({"enable_thinking": "no"}, "true, false or null"), ({"tools": [], "x": 1}, "'tools', 'x'"),
                         ("yes", "must be an object")):
            r = post(kw)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "chat_template_kwargs" and said in err["message"], r.text


def test_a_template_without_thinking_keeps_the_reply_whole(rt_int8):
    """A plain template (the tiny bundle's ChatML): no reasoning_content field, content untouched."""
    import httpx

    from tests.serving import serving

    pytest.importorskip("starlette")
    with serving(rt_int8) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, "temperature": 0},
                       timeout=120)
        assert r.status_code == 200 and "reasoning_content" not in r.json()["choices"][0]["message"]
