"""A grammar compiled against a bundle's tokenizer: `compile_grammar` (within a CPU budget, its
errors found before a request is queued) gives a `GrammarConstraint`, the runtime's Constraint
(constraint.py) for one reply, whose every mask is held to a CPU budget of its own."""
from __future__ import annotations

import time

import numpy as np

from edgekv.runtime.grammar_engine import (COMPILE_BUDGET_S, MASK_BUDGET_S, Grammar, GrammarError, engine_message,
                                           llguidance, parser_limits)
from edgekv.runtime.grammar_tokenizer import GrammarTokenizer


def compile_grammar(tok: GrammarTokenizer, grammar: Grammar,
                    budget_s: float = COMPILE_BUDGET_S) -> "GrammarConstraint":
    """A fresh constraint for one reply; GrammarError if the grammar cannot be enforced, or if
    building and probing it takes more than `budget_s` of this thread's CPU (llguidance builds
    with the GIL released, on the calling thread: its time is this thread's)."""
    what = grammar.kind.replace("_", " ")
    t0 = time.thread_time()

    def spent(stage: str) -> None:
        used = time.thread_time() - t0
        if used > budget_s:
            raise GrammarError(f"{what}: building it took {used:.2f} s of CPU ({stage}), more than the {budget_s:g} s "
                               "a request's grammar may take: the grammar is too large")

    m = llguidance().LLMatcher(tok.ll, grammar.text, log_level=0, limits=parser_limits())
    if m.is_error():
        raise GrammarError(f"{what}: {engine_message(m.get_error())}")
    warnings = m.get_grammar_warnings()
    if warnings:  # a warning is something the engine would not enforce as written
        raise GrammarError(f"{what}: {engine_message(warnings[0])}")
    spent("the compile")
    said = _first_step(m, tok)
    if said:
        raise GrammarError(f"{what}: {said}")
    spent("its first token")
    for pattern in grammar.patterns:
        said = _pattern_alone(tok, pattern)
        if said:
            raise GrammarError(f"{what}: the pattern {pattern[:80]!r}: {said}")
        spent(f"the pattern {pattern[:40]!r}")
    return GrammarConstraint(m, tok)


def _pattern_alone(tok: GrammarTokenizer, pattern: str) -> str | None:
    """_first_step of a schema's regex as a grammar of its own (one it cannot read as such is
    left to the schema's compile, which read it already)."""
    llg = llguidance()
    try:
        alone = llg.LLMatcher(tok.ll, llg.LLMatcher.grammar_from_regex(pattern), log_level=0, limits=parser_limits())
    except ValueError:
        return None
    return None if alone.is_error() else _first_step(alone, tok)


def _first_step(m, tok: GrammarTokenizer) -> str | None:
    """What goes wrong in the grammar's first mask and first token, tried on a copy of the matcher
    (`m` stays at its start), or None: what the engine finds only once it runs (a rule that never
    ends, a lexer past its limits) is a GrammarError before a request is queued, not a failed reply."""
    probe = GrammarConstraint(m.deep_copy(), tok)
    try:
        ok = probe.allowed().copy()
    except GrammarError as e:
        return str(e).removeprefix("grammar: ")
    ok[[t for t in tok.stop_ids if t < ok.shape[0]]] = False
    if ok.any() and not probe.m.consume_token(int(np.argmax(ok))):
        return engine_message(probe.m.get_error())
    return None


class GrammarConstraint:
    """One reply's grammar state over llguidance's LLMatcher (the Constraint protocol).
    `allowed` is computed once per state (a second call before `accept` returns the same mask, or
    raises the same error); `mask_s` / `masks` add up the mask time, for benchmarks and stats.
    A mask that takes more than `mask_budget_s` of CPU ends the reply (GrammarError)."""

    def __init__(self, matcher, tok: GrammarTokenizer, mask_budget_s: float = MASK_BUDGET_S):
        self.m, self.tok = matcher, tok
        self.mask_budget_s = mask_budget_s
        self._bits = np.zeros((1, (tok.vocab_size + 31) // 32), np.int32)  # llguidance's bitmask [1, W]
        self._ok: np.ndarray | None = None  # the mask of the current state, once computed
        self._error: GrammarError | None = None  # the reply cannot go on: raised again, never recomputed
        self.mask_s, self.masks = 0.0, 0

    def allowed(self) -> np.ndarray:
        if self._error is not None:
            raise self._error
        if self._ok is None:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            row = self._bits[0]
            self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            cpu = time.thread_time() - cpu0
            self._raise_if_error()
            if cpu > self.mask_budget_s:
                self._error = GrammarError(f"grammar: one token's mask took {cpu * 1e3:.0f} ms of CPU, more than the "
                                           f"{self.mask_budget_s * 1e3:g} ms a reply's step may take (the grammar is "
                                           "too costly to follow here)")
                raise self._error
            # bit i of word i // 32 (little-endian words): token i
            ok = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.tok.vocab_size).view(bool)
            if not ok.any():
                self._error = GrammarError("grammar: no token can continue the reply")
                raise self._error
            self._ok = ok
            self.mask_s += time.perf_counter() - t0
            self.masks += 1
        return self._ok

    def accept(self, token: int) -> None:
        if self._ok is not None and not (0 <= token < self._ok.shape[0] and self._ok[token]):
            raise ValueError(f"token {token} is not one the grammar allows here")
        if not self.m.consume_token(int(token)):
            raise ValueError(f"token {token} does not continue the grammar: {engine_message(self.m.get_error())}")
        self._ok = None

    def is_done(self) -> bool:
        """The grammar is complete and nothing may follow (only a stop token is allowed)."""
        return self.m.is_stopped() and not self.m.is_error()

    def is_accepting(self) -> bool:
        """What was accepted so far is a whole reply (a stop token may come next)."""
        return self.m.is_accepting()

    def rollback(self, n: int) -> None:
        """Take back the last n accepted tokens (a stop token counts as one)."""
        if n and not self.m.rollback(n):
            raise ValueError(f"cannot roll the grammar back {n} tokens: {engine_message(self.m.get_error())}")
        self._ok = None

    def reset(self) -> None:
        self.m.reset()
        self._ok, self._error = None, None

    def fresh(self) -> "GrammarConstraint":
        """A new constraint for another reply, at the start of the grammar: llguidance's copy of
        this matcher as it was compiled (no second compile; this one must not have advanced)."""
        if self.masks or self.m.is_error():
            raise ValueError("fresh() copies a constraint that has not started its reply")
        return GrammarConstraint(self.m.deep_copy(), self.tok, self.mask_budget_s)

    def _raise_if_error(self) -> None:
        if self.m.is_error():  # a limit hit while computing the mask: never go on unconstrained
            self._error = GrammarError(f"grammar: {engine_message(self.m.get_error())}")
            raise self._error
