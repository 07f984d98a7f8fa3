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
