"""A reply's reasoning part (`<think>…</think>`, Qwen3's and SmolLM3's thinking mode) told apart
from its answer while it streams.

    split = ReasoningSplitter()            # or ReasoningSplitter(in_reasoning=True): see below
    for piece in stream:                   # text pieces as the detokenizer yields them
        part = split.push(piece)           # Part(reasoning="...", content="...")
        ...                                # either may be "": nothing of that kind yet
    part = split.flush()                   # at the end of the reply: whatever was held back

A tag may arrive cut across pieces ("</th", "ink>"): text that could still be the start of the
tag being looked for is held back until the next piece decides it, so no piece of a tag is ever
shown as text and no text is lost. Within one push the reasoning comes before the content (the
reply goes start -> reasoning -> content, never back), so a Part says everything about a piece;
a server maps it onto an OpenAI delta: {"reasoning_content": part.reasoning, "content":
part.content}, leaving out the empty ones.

Only a `<think>` at the very start of the reply (after blank space) opens the reasoning; one later
in the answer is the answer's text. The answer's leading newlines after `</think>` are dropped
(as the templates drop them when the reply goes back into the conversation). A template that
ends its generation prompt inside an open `<think>` (some thinking-only models) makes the reply
start in the reasoning: `in_reasoning=opens_reasoning(prompt_text)`.
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Part:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def template_thinks(chat_template: str | None) -> bool:
    """The chat template has a thinking mode (Qwen3's and SmolLM3's mention enable_thinking, and
    <think> where they strip or pre-fill it): its replies may open with a <think> part."""
    return bool(chat_template) and ("enable_thinking" in chat_template or OPEN in chat_template)


def opens_reasoning(prompt_text: str, open_tag: str = OPEN, close_tag: str = CLOSE) -> bool:
    """The rendered prompt leaves a `<think>` open: the reply starts in its reasoning."""
    i = prompt_text.rfind(open_tag)
    return i >= 0 and prompt_text.find(close_tag, i) < 0


def _held(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (kept back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool = False, open_tag: str = OPEN, close_tag: str = CLOSE):
        self.open_tag, self.close_tag = open_tag, close_tag
        self.state = "reasoning" if in_reasoning else "start"  # start -> reasoning -> answer_start -> content
        self.pending = ""  # text not yet given out: it may be part of a tag

    def push(self, piece: str) -> Part:
        self.pending += piece
        reasoning, content = [], []
        while True:
            if self.state == "start":
                text = self.pending.lstrip()
                if text.startswith(self.open_tag):
                    self.pending, self.state = text[len(self.open_tag):], "reasoning"
                    continue
                if self.open_tag.startswith(text):  # blank, or a start of <think>: wait for more
                    break
                self.state = "content"  # no reasoning: the whole reply is the answer
                continue
            if self.state == "reasoning":
                i = self.pending.find(self.close_tag)
                if i >= 0:
                    reasoning.append(self.pending[:i])
                    self.pending, self.state = self.pending[i + len(self.close_tag):], "answer_start"
                    continue
                keep = _held(self.pending, self.close_tag)
                reasoning.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            if self.state == "answer_start":
                self.pending = self.pending.lstrip("\n")
                if not self.pending:
                    break
                self.state = "content"
                continue
            content.append(self.pending)  # content: given out as it comes
            self.pending = ""
            break
        return Part("".join(reasoning), "".join(content))

    def flush(self) -> Part:
        """The end of the reply: text held back is what it is (an unclosed reasoning stays
        reasoning; a reply that was only a start of `<think>` is its answer)."""
        text, self.pending = self.pending, ""
        if self.state == "reasoning":
            return Part(reasoning=text)
        if self.state == "start":
            return Part(content=text.strip() and text)
        return Part(content=text)


def split_reply(text: str, in_reasoning: bool = False) -> Part:
    """A whole reply at once: (reasoning, answer)."""
    s = ReasoningSplitter(in_reasoning)
    a, b = s.push(text), s.flush()
    return Part(a.reasoning + b.reasoning, a.content + b.content)
