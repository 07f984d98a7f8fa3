"""Stop strings: a reply's text cut before the first one to complete, whatever pieces the tokens
decode to, holding back only what could still be the start of one."""
from __future__ import annotations

from edgekv.runtime.text import StreamDecoder, TextCodec


def _held_back(pending: str, stops: list[str]) -> int:
    """Length of the longest suffix of `pending` that is a proper prefix of some stop string:
    the only text that could still turn out to be part of a stop."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(pending)), best, -1):
            if s.startswith(pending[len(pending) - k:]):
                best = k
                break
    return best


class StopText:
    """Text pieces in, text out cut before the first stop string to complete (the one ending
    first; of those ending together, the longest), whatever the pieces; holds back only text that
    could still be the start of a stop string and emits the rest at once. `matched`: the stop
    string that cut it (Anthropic's stop_sequence)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.pending += text
        found = [(i + len(s), i) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            self.stopped = True
            end, at = min(found)
            self.matched = self.pending[at:end]
            out, self.pending = self.pending[:at], ""
            return out
        keep = 0 if final else _held_back(self.pending, self.stops)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out


class StopWatch:
    """Turns the token stream into text (never half a character), cut at the first stop."""

    def __init__(self, codec: TextCodec, stops: list[str]):
        self.dec = StreamDecoder(codec)
        self.cut = StopText(stops)

    @property
    def stopped(self) -> bool:
        return self.cut.stopped

    @property
    def matched(self) -> str | None:
        return self.cut.matched

    def push(self, token: int) -> str:
        return self.cut.push(self.dec.push(token))

    def flush(self) -> str:
        return self.cut.push(self.dec.flush(), final=True)
