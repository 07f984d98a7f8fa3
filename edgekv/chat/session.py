"""ChatSession: multi-turn chat that keeps its KV cache between turns.

The conversation is a kept sequence of the runtime's Batcher (the one `edgekv serve` runs), stepped
on the caller's thread. Each turn renders the whole conversation with the bundle's chat template,
finds the longest prefix the sequence already holds (it tracks its token ids) and sends only the
rest, the new message and the template glue, as one request appending to it. When the
conversation outgrows the cache, its context policy (policies.py: ring or drop-turns) decides
what goes. The terminal front end is terminal.py, the
saved-chat format persistence.py."""
from __future__ import annotations

import time
import uuid

import numpy as np

from edgekv.chat import persistence
from edgekv.chat.conversation import Conversation, common_prefix
from edgekv.chat.policies import CONTEXT_POLICIES, POLICIES
from edgekv.errors import EdgeKVError
from edgekv.runtime.batching import Batcher, Request, Token
from edgekv.runtime.stats import Stats, stats_of
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.text import StreamDecoder


class ChatSession:
    def __init__(self, bundle, codec, batcher: Batcher, params: SamplingParams, system: str | None,
                 max_new_tokens: int, context: str = "drop-turns", reply_grammar=None):
        """reply_grammar: a compiled GrammarConstraint (runtime/grammar_constraint.py) every reply follows
        (chat --json-schema); each turn gets a fresh copy of it (None: free replies)."""
        if context not in CONTEXT_POLICIES:
            raise EdgeKVError(f"unknown context policy {context!r}; choose {' or '.join(CONTEXT_POLICIES)}")
        self.bundle, self.codec, self.batcher = bundle, codec, batcher
        self.seq = batcher.hold()  # the conversation's cells in the batcher's pool
        self.params, self.max_new = params, max_new_tokens
        self.rng = np.random.default_rng(params.seed)
        self.policy = POLICIES[context]
        self.conv = Conversation(codec, system)
        self.policy.prepare(self.seq, codec, system)
        self.last: Stats | None = None  # the last completed turn's (None: none since the start or a /load)
        # every completed turn since the chat started, (its stats, the KV bytes held after it): /stats' totals
        self.turns: tuple[tuple[Stats, int], ...] = ()
        self.loaded_from: str | None = None  # the file of the last /load
        # which conversation this is, in its saved chats: a plain /save replaces only those (/load takes the file's)
        self.conversation_id = uuid.uuid4().hex
        self.last_prompt_ids: list[int] = []
        self.reply_grammar = reply_grammar

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
        return self.seq.ids

    @property
    def cache(self):
        return self.batcher.cache

    @property
    def dropped_turns(self) -> int:
        return self.conv.dropped_turns

    def prompt_ids(self, user: str) -> list[int]:
        """The ids the next turn with `user` would feed, before any policy drops turns."""
        return self.conv.prompt_ids(user, self.seq.ids)

    # -- the cache follows the conversation
    def _keep_common_prefix(self, target: list[int]) -> int:
        """Truncate the sequence to the longest prefix it shares with `target`; return its length.
        A ring that has wrapped cannot be truncated (its cells lost their first tokens), nor a
        windowed pool's sequence whose local layers' ring lost the window before it: it starts over."""
        in_cache = self.seq.ids
        n = common_prefix(in_cache, target)
        if n < len(in_cache):
            if not self.batcher.can_truncate(self.seq, n):
                self.batcher.reset(self.seq)
                n = 0
            else:
                self.batcher.truncate(self.seq, n)
        return n

    def _common(self, target: list[int]) -> int:
        """Keep what the cache holds of `target`; the model needs at least one new token to produce logits."""
        n = self._keep_common_prefix(target)
        if n == len(target):
            n = self._keep_common_prefix(target[:-1])
        return n

    def reply(self, user: str, write=None):
        """Answer one user message; stream text pieces to `write`. Returns (text, Stats).
        A turn is all or nothing: Ctrl-C (KeyboardInterrupt) or an error anywhere in it puts the
        conversation back exactly as it was before it (messages, cache cells, ids, positions, the
        sampler's state); an interrupted turn returns ("", stats with stop_reason "interrupted"),
        an error is raised after the rollback."""
        write = write or (lambda s: None)
        st = Stats()
        dec = StreamDecoder(self.codec)
        pieces = []

        def emit(event):
            if isinstance(event, Token):
                piece = dec.push(event.id)
                if piece:
                    pieces.append(piece)
                    write(piece)

        def turn() -> str:
            target = self.policy.fit(self.conv, user, self.seq, self.max_new)
            n = self._common(target)
            constraint, stop_ids = self._turn_constraint()
            # the stop token (or the last one) is fed too: the cache holds the turn as the template renders it
            req = Request(target[n:], self.max_new, self.params, stop_ids, emit=emit, seq=self.seq,
                          feed_last=True, rng=self.rng, constraint=constraint)
            self.batcher.run(req)
            tail = dec.flush()
            if tail:
                pieces.append(tail)
                write(tail)
            text = "".join(pieces)
            self.conv.add_exchange(user, text)
            self.last_prompt_ids = list(target)
            self.last = stats_of(req, t0)
            self.turns += ((self.last, self.cache.used_bytes(self.seq.n)),)  # a new tuple: the rollback restores it
            return text

        t0 = time.perf_counter()
        before = (list(self.conv.messages), self.conv.dropped_turns, self.rng.bit_generator.state, self.last,
                  self.last_prompt_ids, self.turns)
        try:  # (one line: an interrupt once the turn is whole finds nothing left to run here)
            return self._whole(turn, lambda: self._put_turn_state(before)), self.last
        except KeyboardInterrupt:
            st.stop_reason = "interrupted"  # self.last stays the last completed turn's
            return "", st

    def _whole(self, change, undo):
        """change() in one batcher turn, all or nothing; returns what it returns. An exception
        before the turn commits rolls it back: the turn's rollback calls undo() (the session's own
        fields) before it puts the cells back, and again if a second interrupt cuts it short and
        it is done again. One after the commit keeps everything (what it interrupts is whole): a
        KeyboardInterrupt is dropped, any other exception raised."""
        turn, out = None, []
        try:
            with self.batcher.turn(undo) as turn:
                out.append(change())
            return out[0]
        except BaseException as e:
            if turn is not None and turn.committed:
                if isinstance(e, KeyboardInterrupt):
                    return out[0]
                raise
            self.batcher.rollback()  # a rollback cut short (or a turn begun before `as turn`): done whole here
            raise

    def _turn_constraint(self):
        """(this turn's constraint, its stop ids): a fresh matcher of the reply grammar, every end
        it may choose a stop; (None, the codec's stop ids) for free replies."""
        if self.reply_grammar is None:
            return None, self.codec.stop_ids
        return self.reply_grammar.fresh(), set(self.codec.stop_ids) | set(self.reply_grammar.tok.stop_ids)

    def _put_turn_state(self, before) -> None:
        (self.conv.messages, self.conv.dropped_turns, self.rng.bit_generator.state, self.last,
         self.last_prompt_ids, self.turns) = before  # one statement: whole

    def undo(self) -> bool:
        if not self.conv.undo():
            return False
        # the cache keeps what still matches; the next turn prefills only the difference
        self._keep_common_prefix(self.conv.render(self.conv.msgs(), self.seq.ids))
        return True

    def reset(self) -> None:
        self.conv.messages = []
        self.batcher.reset(self.seq)
        self.policy.prepare(self.seq, self.codec, self.system)  # the system prompt may have changed

    def set_system(self, text: str | None) -> None:
        """A new system prompt resets the conversation; one the policy refuses changes nothing."""
        before = (self.system, list(self.conv.messages))

        def change() -> None:
            self.system = text
            self.reset()  # moves no KV data: going back is the turn's bookkeeping

        self._whole(change, lambda: self._put_system_state(before))

    def _put_system_state(self, before) -> None:
        self.system, self.conv.messages = before  # one line: whole

    def prefill(self, ids: list[int]) -> None:
        """Feed `ids` to the empty conversation, sampling nothing (the system prompt alone)."""
        self.batcher.reset(self.seq)
        self.batcher.run(Request(ids, 0, seq=self.seq))

    # -- persistence (persistence.py)
    def warm_system(self, prompt_cache: str | None) -> str:
        return persistence.warm_system(self, prompt_cache)

    def save(self, path: str, replace_any: bool = False) -> None:
        """Save the conversation; over nothing, an empty file or its own saved chat unless
        `replace_any` (/save! FILE: any regular file)."""
        if not replace_any:
            persistence.check_replaceable(path, self.conversation_id)
        persistence.save(self, path)

    def load(self, path: str, trust_unrecorded: bool = False) -> tuple[int, int]:
        """Replace the conversation with a saved one; returns (exchanges, cached tokens) loaded.
        All or nothing, a Ctrl-C included: the file is read and checked whole first; then the
        messages and the cells change inside one batcher turn, which an interrupt anywhere in it
        rolls back; one that comes once the load is whole has nothing left to cancel."""
        saved = persistence.read(self, path, trust_unrecorded)
        loaded = len(saved.meta["messages"]) // 2, saved.n
        conversation = saved.meta.get("conversation") or self.conversation_id  # (older files have none)
        before = self._loaded_state()

        def change() -> tuple[int, int]:
            self._set_loaded_state((saved.meta["system"], saved.meta["messages"], 0, None, str(path),
                                    conversation, []))
            persistence.restore(self, saved)
            return loaded

        return self._whole(change, lambda: self._set_loaded_state(before))

    def _loaded_state(self) -> tuple:
        """What a /load replaces beside the cells: the conversation and what /stats says of it."""
        return (self.conv.system, self.conv.messages, self.conv.dropped_turns, self.last, self.loaded_from,
                self.conversation_id, self.last_prompt_ids)

    def _set_loaded_state(self, state: tuple) -> None:
        (self.conv.system, self.conv.messages, self.conv.dropped_turns, self.last, self.loaded_from,
         self.conversation_id, self.last_prompt_ids) = state
