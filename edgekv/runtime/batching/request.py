"""A request: the immutable ask (what the caller wants) and its state while it runs, as llama-server
splits its task from its slot. The scheduler and the post-processing change the state through the
methods below, on the stepping thread; a caller on another thread (serve's HTTP side) gets typed
events (`Token`, `Done`) through the ask's `emit` and never reads fields that thread is writing;
a caller that steps on its own thread (`Batcher.run`: chat, eval-context) reads the request once
it has ended."""
from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np

from edgekv.runtime.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from edgekv.runtime.batching.poolseq import PoolSequence
    from edgekv.runtime.constraint import Constraint


def now() -> float:
    """The batcher's clock (one module to patch in tests)."""
    return time.perf_counter()


class State(Enum):
    WAITING = "waiting"  # in the queue (again, after a preemption)
    PREFILLING = "prefilling"  # its feed (the prompt; after a preemption, and the reply so far) goes in
    DECODING = "decoding"  # its next token is sampled and goes in at the next step
    CLOSING = "closing"  # finished; its last token still goes in (feed_last) so the cells hold it
    DONE = "done"


# the states by module names too, for the step's code: `State.X` goes through Enum's metaclass,
# ~0.1 us a lookup in CPython 3.11, and the step asks several per request
WAITING, PREFILLING, DECODING, CLOSING, DONE = (State.WAITING, State.PREFILLING, State.DECODING, State.CLOSING,
                                                State.DONE)
DECODES = (DECODING, CLOSING)  # its sampled token goes in at the next step


class Usage(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # of the prompt, taken from the prefix cache


class Token(NamedTuple):  # (a tuple: one is made per token)
    id: int
    # on a request's first token only: submit to it, and the prompt tokens taken from the prefix cache
    ttft_s: float | None = None
    cached_tokens: int | None = None
    logprob: TokenLogprob | None = None  # when the ask wants logprobs: this token's and the top-N


class Done(NamedTuple):
    reason: str  # "stop" | "length" | "context" | "cancelled" | "error"
    usage: Usage
    error: str | None = None  # why, for "error" (one line)


Event = Token | Done


@dataclass(frozen=True, eq=False)
class Ask:
    prompt: tuple[int, ...]
    max_tokens: int  # the caller's; the scheduler's cap of it is Request.max_new
    params: SamplingParams
    stop_ids: frozenset[int]
    emit: Callable[[Event], None] | None  # called on the stepping thread
    record_logits: bool  # keep a copy of every sampled-from logits row (tests)
    seq: "PoolSequence | None"  # append to this kept sequence (chat: the prompt is only what is new); None: its own
    feed_last: bool  # feed the last token (a stop token too) so a kept sequence holds the whole turn
    tenant: str  # whose prompt it is (an API key's id): prefixes are reused only within a tenant
    constraint: "Constraint | None"  # restricts each next token (issue 26); None: any
    # teacher forcing (eval-context): the logits rows of the prompt's tokens from this index on are
    # kept in Request.logits as they are fed (the backend must return that many rows per call)
    logits_from: int | None
    logprobs: int | None  # alternatives per token to report with each Token (0: only its own); None: none


class Request:
    def __init__(self, prompt, max_tokens: int, params: SamplingParams | None = None, stop_ids=(),
                 emit: Callable[[Event], None] | None = None, record_logits: bool = False,
                 seq: "PoolSequence | None" = None, feed_last: bool = False, rng: np.random.Generator | None = None,
                 tenant: str = "", constraint: "Constraint | None" = None, logits_from: int | None = None,
                 logprobs: int | None = None):
        params = params or SamplingParams()
        if feed_last and seq is None:  # a request's own cells are freed at its end: nothing would hold it
            raise ValueError("feed_last appends the last token to a kept sequence; this request has none")
        self.ask = Ask(tuple(int(t) for t in prompt), max_tokens, params, frozenset(stop_ids), emit, record_logits,
                       seq, feed_last, tenant, constraint, logits_from, logprobs)
        self.rng = rng if rng is not None else np.random.default_rng(params.seed)
        # its sequence outlives it (chat): it reserves all it may add, is never preempted, and an
        # error in it is raised to the caller (whose turn rolls back) instead of ending it alone
        self.kept = seq is not None
        self.state = WAITING
        self.cancelled = False  # set by any thread (`Batcher.cancel`); acted on at the next step
        # the scheduler's
        self.seq = seq  # its cells: the ask's kept sequence, or one of its own while it runs
        self.feed: list[int] = []  # to prefill
        self.fed = 0  # tokens of feed in cells
        self.max_new = 0  # max_tokens capped to the room left after the prompt
        self.limit_reason = "length"  # why it ends at max_new ("context": capped to the room left)
        self.order = 0  # arrival number: the youngest running request is preempted first
        self.preempted = 0  # times its cells were taken back (it then prefilled again)
        self.reused = 0  # prompt tokens taken from the prefix cache
        self.budget = 0  # cells reserved for it and not yet written
        # the post-processing's
        self.out: list[int] = []
        self.next_token: int | None = None  # sampled, fed at the next step
        self.end_reason: str | None = None  # CLOSING: the reason it ends once its last token is fed
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.t_submit = 0.0
        self.ttft_s: float | None = None
        self.t_last = 0.0  # when its last decode call (one sampled from) returned
        self.decode_steps = 0  # decode calls sampled from, after the first token
        self.logits: list[np.ndarray] = []

    @property
    def prompt(self) -> list[int]:
        return list(self.ask.prompt)

    @property
    def max_tokens(self) -> int:
        return self.ask.max_tokens

    def usage(self) -> Usage:
        return Usage(len(self.ask.prompt), len(self.out), self.reused)

    # -- the scheduler's
    def queued(self, max_new: int, limit_reason: str) -> None:
        self.feed, self.max_new, self.limit_reason = list(self.ask.prompt), max_new, limit_reason
        self.t_submit = now()

    def arrived(self, order: int) -> None:
        self.order = order

    def cancel(self) -> None:
        """From any thread (a client gone): the scheduler ends it at its next step."""
        self.cancelled = True

    def admitted(self, seq: "PoolSequence", fed: int, budget: int) -> None:
        self.seq, self.fed, self.budget, self.state = seq, fed, budget, PREFILLING
        if not self.preempted:  # cached tokens of its own prompt, not of its first admission's work
            self.reused = fed

    def granted(self, cells: int) -> None:
        self.budget += cells

    def took_back(self) -> None:
        """Preempted: its prompt and reply so far to prefill again when it is readmitted."""
        self.feed = list(self.ask.prompt) + self.out
        self.seq, self.fed, self.budget, self.next_token, self.state = self.ask.seq, 0, 0, None, WAITING
        self.preempted += 1

    # -- after a call wrote n of its tokens
    def wrote(self, n: int, decode: bool, now: float) -> None:
        self.budget -= n
        assert self.budget >= 0, "a request wrote more cells than it had reserved"
        if decode:
            self.next_token = None
            if self.state is not CLOSING:
                self.decode_steps += 1
                self.t_last = now
        else:
            self.fed += n

    # -- the post-processing's
    def scored(self, rows: np.ndarray) -> None:
        self.logits.extend(row.copy() for row in rows)

    def sampled(self, tok: int, row: np.ndarray) -> float | None:
        """A token was drawn from `row`; returns the TTFT on the first."""
        if self.ask.record_logits:
            self.logits.append(row.copy())
        if self.ttft_s is None:
            self.ttft_s = now() - self.t_submit
            return self.ttft_s
        return None

    def add(self, tok: int) -> None:
        self.out.append(tok)

    def goes_on(self, tok: int, end_reason: str | None = None) -> None:
        """`tok` goes in at the next step; with `end_reason` it is the last (CLOSING)."""
        self.next_token, self.end_reason = tok, end_reason
        self.state = CLOSING if end_reason else DECODING

    def finished(self, reason: str, error: str | None = None) -> Done:
        self.finish_reason, self.next_token, self.budget, self.state = reason, None, 0, DONE
        if error is not None:
            self.error = error
        return Done(reason, self.usage(), self.error)
