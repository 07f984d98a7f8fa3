"""What chat does when a conversation outgrows the cache (--context):

  ring (default)  the first tokens (system prompt, attention sinks) stay, the oldest of the rest
                  are overwritten (StreamingLLM); nothing is prefilled again. When positions reach
                  the bundle's verified context, old turns are dropped once and the kept ones
                  re-prefilled from position 0.
  drop-turns      whole old exchanges are dropped and the kept turns prefilled again.

docs/chat.md has what `edgekv eval-context` measured for each."""
from __future__ import annotations

from edgekv.chat.conversation import Conversation, sink_count
from edgekv.errors import ContextOverflow, EdgeKVError
from edgekv.runtime.batching import PoolSequence
from edgekv.runtime.text import TextCodec


class DropTurns:
    name = "drop-turns"

    def prepare(self, seq: PoolSequence, codec: TextCodec, system: str | None) -> None:
        """Set up an empty sequence for this policy."""
        seq.disable_ring()

    def fit(self, conv: Conversation, user: str, seq: PoolSequence, max_new: int) -> list[int]:
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

    def prepare(self, seq: PoolSequence, codec: TextCodec, system: str | None) -> None:
        """The system prompt's slots are the sinks. They may take at most half the cache: a longer
        system prompt is refused, never partly overwritten."""
        sinks = sink_count(codec, system)
        if sinks > seq.capacity // 2:
            raise ContextOverflow(f"system prompt too long for the ring: {sinks} tokens, the ring keeps at most "
                                  f"half the cache ({seq.capacity // 2})", setting="capacity", fix="raise {}")
        seq.disable_ring()
        seq.enable_ring(sinks)

    def fit(self, conv: Conversation, user: str, seq: PoolSequence, max_new: int) -> list[int]:
        # a ring overwrites what does not fit in the cache, but positions must stay verified: it
        # keeps going while a whole reply still has positions left, then drops turns once
        self.check_message(conv, user, seq)
        target = conv.prompt_ids(user, seq.ids)
        if len(target) + min(max_new, seq.max_positions // 4) <= seq.max_positions:
            return target
        return super().fit(conv, user, seq, max_new)

    @staticmethod
    def check_message(conv: Conversation, user: str, seq: PoolSequence) -> None:
        """One message (with its template glue) must fit in the ring beside the sinks: the ring
        would otherwise overwrite its own start before the model has read to its end."""
        alone = len(conv.render(conv.msgs_alone(user), [])) - (seq.sinks or 0)
        room = seq.capacity - (seq.sinks or 0)
        if alone > room:
            raise ContextOverflow(f"message too long: {alone} tokens, the ring holds {room} beside the system "
                                  f"prompt", setting="capacity", fix="raise {}")


POLICIES = {p.name: p for p in (Ring(), DropTurns())}
CONTEXT_POLICIES = tuple(POLICIES)  # ("ring", "drop-turns"): the first is chat's default
