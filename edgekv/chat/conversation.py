"""The conversation: its messages, and the token ids that render them with the chat template."""
from __future__ import annotations

from edgekv.runtime.text import TextCodec, system_turn


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sink_count(codec: TextCodec, system: str | None) -> int:
    """Tokens before the first user message's text: the system prompt and its template glue."""
    a = codec.chat_ids(system_turn(system) + [{"role": "user", "content": "alpha"}])
    b = codec.chat_ids(system_turn(system) + [{"role": "user", "content": "omega"}])
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Conversation:
    def __init__(self, codec: TextCodec, system: str | None):
        self.codec, self.system = codec, system
        self.messages: list[dict] = []
        self.dropped_turns = 0  # old exchanges dropped to make room

    def msgs(self, extra=()) -> list[dict]:
        return system_turn(self.system) + self.messages + list(extra)

    def msgs_alone(self, user: str) -> list[dict]:
        """The system turn and one user message, nothing between."""
        return system_turn(self.system) + [{"role": "user", "content": user}]

    def render(self, msgs: list[dict], in_cache: list[int]) -> list[int]:
        """Token ids of the conversation `msgs` plus the generation prompt. Where the rendered text
        only appends to what the cache holds (`in_cache`), the in_cache ids are kept as they are
        (re-tokenizing a generated reply can split it differently) and only the appended text is
        tokenized."""
        new_text = self.codec.render(msgs, add_generation_prompt=True)
        if in_cache:
            cached_text = self.codec.tok.decode(in_cache, skip_special_tokens=False)
            if new_text.startswith(cached_text):
                return list(in_cache) + self.codec.encode(new_text[len(cached_text):])
        return self.codec.encode(new_text)

    def prompt_ids(self, user: str, in_cache: list[int]) -> list[int]:
        """The ids of the conversation with the new user message, ready for the reply."""
        return self.render(self.msgs([{"role": "user", "content": user}]), in_cache)

    def drop_oldest_exchange(self) -> None:
        """Drop the oldest exchange (user + assistant) as a whole."""
        self.messages = self.messages[2:] if len(self.messages) >= 2 else []
        self.dropped_turns += 1

    def add_exchange(self, user: str, reply: str) -> None:
        self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]

    def undo(self) -> bool:
        if len(self.messages) < 2:
            return False
        self.messages = self.messages[:-2]
        return True
