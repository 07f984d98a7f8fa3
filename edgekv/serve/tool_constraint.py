"""The constraint of a reply that may make several tool calls: the compiled grammar (which
admits one list of at most MAX_PARALLEL_CALLS calls), ended as soon as a call's arguments repeat
an earlier call of the same reply, name and arguments as written (a small model, greedy, repeats
its call until the list's bound otherwise). The repeat is dropped from the reply (ToolStream)."""
from __future__ import annotations

import codecs

from edgekv.serve.tool_stream import ToolStream


class RepeatStops:
    """The Constraint protocol over a GrammarConstraint (its other attributes: the inner one's)."""

    def __init__(self, inner, tok):
        self.inner, self.tok = inner, tok
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stream = ToolStream(lambda i: "")

    def allowed(self):
        return self.inner.allowed()

    def accept(self, token: int) -> None:
        self.inner.accept(token)
        self._stream.feed(self._text.decode(self.tok.ll.decode_bytes([int(token)])))

    def is_done(self) -> bool:
        return self._stream.repeats > 0 or self.inner.is_done()

    def __getattr__(self, name):  # mask_s, masks, is_accepting, ...: the grammar's own
        return getattr(self.inner, name)
