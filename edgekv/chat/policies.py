"""What chat does when a conversation outgrows the cache (--context):

  ring (default)  the first tokens (system prompt, attention sinks) stay, the oldest of the rest
                  are overwritten (StreamingLLM); nothing is prefilled again. When positions reach
                  the bundle's verified context, old turns are dropped once and the kept ones
                  re-prefilled from position 0.
  drop-turns      whole old exchanges are dropped and the kept turns prefilled again.

docs/chat.md has what `edgekv eval-context` measured for each."""
from __future__ import annotations

from edgekv.chat.conversation import Conversation, sink_count
from edgekv.errors import EdgeKVError
from edgekv.runtime.sequence import Sequence
from edgekv.runtime.text import TextCodec


class DropTurns:
    name = "drop-turns"

    def prepare(self, seq: Sequence, codec: TextCodec, system: str | None) -> None:
        """Set up an empty sequence for this policy."""
        seq.disable_ring()

    def fit(self, conv: Conversation, user: str, seq: Sequence, max_new: int) -> list[int]:
        """Token ids for the conversation + the new message, dropping old turns until the prompt
        leaves room for a reply (min(max_new, a quarter of the cache))."""
        cap = seq.capacity
        room_for_reply = min(max_new, cap // 4)
        target = conv.prompt_ids(user, seq.ids)
        while len(target) + room_for_reply > cap and conv.messages:
            conv.drop_oldest_exchange()
            target = conv.prompt_ids(user, seq.ids)
        if len(target) >= cap:
            raise EdgeKVError(f"message too long: {len(target)} tokens with the system prompt, the cache holds "
                              f"{cap}", setting="capacity", fix="raise {}")
        return target


class Ring(DropTurns):
    name = "ring"

    def prepare(self, seq: Sequence, codec: TextCodec, system: str | None) -> None:
        """The system prompt's slots are the sinks (at most half the cache)."""
        seq.disable_ring()
        seq.enable_ring(min(sink_count(codec, system), seq.capacity // 2))

    def fit(self, conv: Conversation, user: str, seq: Sequence, max_new: int) -> list[int]:
        # a ring overwrites what does not fit in the cache, but positions must stay verified: it
        # keeps going while a whole reply still has positions left, then drops turns once
        target = conv.prompt_ids(user, seq.ids)
        if len(target) + min(max_new, seq.max_positions // 4) <= seq.max_positions:
            return target
        return super().fit(conv, user, seq, max_new)


POLICIES = {p.name: p for p in (Ring(), DropTurns())}
CONTEXT_POLICIES = tuple(POLICIES)  # ("ring", "drop-turns"): the first is chat's default
