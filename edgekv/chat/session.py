"""ChatSession: multi-turn chat that keeps its KV cache between turns.

Each turn renders the whole conversation with the bundle's chat template, finds the longest
prefix the sequence already holds (it tracks its token ids) and prefills only the rest: the new
message and the template glue. When the conversation outgrows the cache, its context policy
(policies.py: ring or drop-turns) decides what goes. The terminal front end is terminal.py, the
saved-chat format persistence.py."""
from __future__ import annotations

import time

import numpy as np

from edgekv.chat import persistence
from edgekv.chat.conversation import Conversation, common_prefix
from edgekv.chat.policies import CONTEXT_POLICIES, POLICIES
from edgekv.errors import EdgeKVError
from edgekv.runtime.generate import Generator, Stats
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.text import StreamDecoder


class ChatSession:
    def __init__(self, bundle, codec, gen: Generator, params: SamplingParams, system: str | None,
                 max_new_tokens: int, context: str = "drop-turns"):
        if context not in CONTEXT_POLICIES:
            raise EdgeKVError(f"unknown context policy {context!r}; choose {' or '.join(CONTEXT_POLICIES)}")
        self.bundle, self.codec, self.gen = bundle, codec, gen
        self.params, self.max_new = params, max_new_tokens
        self.rng = np.random.default_rng(params.seed)
        runs = context if gen.backend.runs_ring or context != "ring" else "drop-turns"
        self.policy = POLICIES[runs]
        self.note = "" if runs == context else \
            f"(context policy: drop-turns; the {gen.backend.name} backend cannot run a ring)"
        self.conv = Conversation(codec, system)
        self.policy.prepare(gen.seq, codec, system)
        self.last = Stats()
        self.last_prompt_ids: list[int] = []

    # -- what the session holds
    @property
    def ring(self) -> bool:
        return self.policy.name == "ring"

    @property
    def system(self) -> str | None:
        return self.conv.system

    @system.setter
    def system(self, text: str | None) -> None:
        self.conv.system = text

    @property
    def messages(self) -> list[dict]:
        return self.conv.messages

    @messages.setter
    def messages(self, msgs: list[dict]) -> None:
        self.conv.messages = msgs

    @property
    def ids(self) -> list[int]:
        """Token ids the cache holds (everything fed since the conversation started over)."""
        return self.gen.seq.ids

    @property
    def dropped_turns(self) -> int:
        return self.conv.dropped_turns

    def prompt_ids(self, user: str) -> list[int]:
        """The ids the next turn with `user` would feed, before any policy drops turns."""
        return self.conv.prompt_ids(user, self.gen.seq.ids)

    # -- the cache follows the conversation
    def _keep_common_prefix(self, target: list[int]) -> int:
        """Truncate the sequence to the longest prefix it shares with `target`; return its length.
        A ring that has wrapped cannot be truncated (its slots are out of order): it starts over."""
        held = self.gen.seq.ids
        n = common_prefix(held, target)
        if n < len(held):
            if self.gen.seq.wrapped:
                self.gen.reset()
                n = 0
            else:
                self.gen.truncate(n)
        return n

    def _sync(self, target: list[int]) -> int:
        """Make the cache hold `target`: keep the common prefix, prefill the rest. Returns the
        number of tokens prefilled."""
        n = self._keep_common_prefix(target)
        if n == len(target):  # the model needs at least one new token to produce logits
            n = self._keep_common_prefix(target[:-1])
        self._logits = self.gen.prefill(target[n:]).copy()
        return len(target) - n

    def reply(self, user: str, write=None):
        """Answer one user message; stream text pieces to `write`. Returns (text, Stats).
        A turn is all or nothing: Ctrl-C (KeyboardInterrupt) or an error anywhere in it puts the
        conversation back exactly as it was before it (messages, cache slots, ids, positions, the
        sampler's state); an interrupted turn returns ("", stats with stop_reason "interrupted"),
        an error is raised after the rollback."""
        write = write or (lambda s: None)
        st = Stats()
        t0 = time.perf_counter()
        dec = StreamDecoder(self.codec)
        pieces = []
        before = (list(self.conv.messages), self.conv.dropped_turns, self.rng.bit_generator.state)
        self.gen.begin_turn()
        try:
            target = self.policy.fit(self.conv, user, self.gen.seq, self.max_new)
            st.prompt_tokens = self._sync(target)  # only what the cache did not already hold
            st.prefill_s = time.perf_counter() - t0
            self._decode(st, dec, pieces, write, t0)
            tail = dec.flush()
        except BaseException as e:
            self._rollback(before)
            if not isinstance(e, KeyboardInterrupt):
                raise
            st.stop_reason = "interrupted"
            self.last = st
            return "", st
        self.gen.end_turn()
        if tail:
            pieces.append(tail)
            write(tail)
        text = "".join(pieces)
        self.conv.add_exchange(user, text)
        self.last_prompt_ids = list(target)
        self.last = st
        return text, st

    def _rollback(self, before) -> None:
        self.gen.rollback()
        self.conv.messages, self.conv.dropped_turns, self.rng.bit_generator.state = \
            before[0], before[1], before[2]

    def _decode(self, st: Stats, dec: StreamDecoder, pieces: list, write, t0: float) -> None:
        for tok in self.gen.decode(self._logits, self.max_new, self.params, self.rng, self.codec.stop_ids,
                                   st, t0, keep_turn=True):
            piece = dec.push(tok)
            if piece:
                pieces.append(piece)
                write(piece)

    def undo(self) -> bool:
        if not self.conv.undo():
            return False
        # the cache keeps what still matches; the next turn prefills only the difference
        self._keep_common_prefix(self.conv.render(self.conv.msgs(), self.gen.seq.ids))
        return True

    def reset(self) -> None:
        self.conv.messages = []
        self.gen.reset()
        self.policy.prepare(self.gen.seq, self.codec, self.system)  # the system prompt may have changed

    def set_system(self, text: str | None) -> None:
        """A new system prompt resets the conversation; one the policy refuses changes nothing."""
        before = (self.system, list(self.conv.messages), self.gen.seq.checkpoint())
        self.system = text
        try:
            self.reset()  # reset moves no KV data: going back is the sequence's checkpoint
        except EdgeKVError:
            self.system, self.conv.messages = before[0], before[1]
            self.gen.seq.rollback(before[2])
            raise

    # -- persistence (persistence.py)
    def warm_system(self, prompt_cache: str | None) -> str:
        return persistence.warm_system(self, prompt_cache)

    def save(self, path: str) -> None:
        persistence.save(self, path)

    def load(self, path: str) -> None:
        persistence.load(self, path)
