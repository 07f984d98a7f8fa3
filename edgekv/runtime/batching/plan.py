"""A step as plain data (vLLM's SchedulerOutput): the scheduler's pieces, then the KV manager's
calls (where each piece's K/V land and the past they see; fused slots': which slots a call's
entries are, slots.py), which the step runner runs. Tuples: a step makes one piece per running
request."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from edgekv.runtime.batching.poolseq import PoolSequence
    from edgekv.runtime.batching.request import Request


class Piece(NamedTuple):
    req: "Request"  # whose tokens these are (the post-processing's)
    seq: "PoolSequence"  # whose cells they join (the KV manager's)
    tokens: list[int]
    decode: bool  # the request's next token (else a run of its feed)
    sample: bool  # its last token's logits row comes back: a decode step, or the feed's last token
    scored: int = 0  # of its last tokens, how many rows come back to be kept (teacher forcing)

    @property
    def rows(self) -> int:
        """Logits rows it gets back: its last `rows` tokens'."""
        return max(self.scored, 1 if self.sample else 0)

    def split(self, n: int) -> tuple["Piece", "Piece"]:
        """The first n tokens (never sampled from) and the rest."""
        rest = len(self.tokens) - n
        return (self._replace(tokens=self.tokens[:n], sample=False, scored=max(0, self.scored - rest)),
                self._replace(tokens=self.tokens[n:], scored=min(self.scored, rest)))


class Call(NamedTuple):
    write: int  # the new tokens' K/V land at cells [write, write + size)
    size: int
    past: int  # cells [0, past) bound as the past
    pieces: list[Piece]
    returned: list[tuple[Piece, int]]  # the pieces whose rows come back, with how many (`Piece.rows`), in order
    freed: int = 0  # cells the first piece's ring gave up (its oldest tokens) to make room for this call

    @classmethod
    def of(cls, write: int, past: int, pieces: list[Piece], freed: int = 0) -> "Call":
        returned = [(p, k) for p, k in zip(pieces, map(Piece.rows.fget, pieces)) if k]
        return cls(write, sum(len(p.tokens) for p in pieces), past, pieces, returned, freed)


class SlotCall(NamedTuple):
    first: int  # the call's entries are slots [first, first + len(entries))
    entries: tuple  # per slot, its Piece or None (idle: its cells untouched)
    pieces: list[Piece]  # the entries' pieces, in slot order
    returned: list[tuple[Piece, int]]  # the pieces whose rows come back, with how many, in order
    freed: int = 0  # (a ring's: never here) the scheduler's books read it

    @classmethod
    def of(cls, first: int, entries: list) -> "SlotCall":
        pieces = [p for p in entries if p is not None]
        returned = [(p, p.rows) for p in pieces if p.rows]
        return cls(first, tuple(entries), pieces, returned)
