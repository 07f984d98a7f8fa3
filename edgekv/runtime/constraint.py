"""The seam between a request and what may restrict its next token (a JSON schema, a grammar, a tool
call: issue 26). The engine's post-processing (every command's decode) calls these three methods and
know nothing else about grammars; edgekv/runtime/grammar_constraint.py implements them with llguidance."""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Constraint(Protocol):
    def allowed(self) -> np.ndarray | None:
        """bool [V]: the tokens allowed next (None: any). Called once per sampled row, before sampling;
        raises EdgeKVError when the grammar cannot go on (a limit hit): the request ends, never
        unconstrained."""

    def accept(self, token: int) -> None:
        """The token sampled (always one `allowed` allowed); raises ValueError on any other."""

    def is_done(self) -> bool:
        """Nothing more may follow (the grammar is complete): the request ends with reason "stop"."""


def constrain(logits: np.ndarray, c: Constraint | None) -> np.ndarray:
    """logits with every token the constraint forbids at -inf (a copy; the input unchanged)."""
    if c is None:
        return logits
    ok = c.allowed()
    if ok is None:
        return logits
    out = np.full_like(logits, -np.inf)
    np.copyto(out, logits, where=ok[: logits.shape[-1]])
    return out
