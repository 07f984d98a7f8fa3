"""Tokenizer, chat template and streaming detokenization."""
from __future__ import annotations

from edgekv.errors import BundleError, EdgeKVError
from edgekv.format.bundle import Bundle


class TextCodec:
    def __init__(self, bundle: Bundle):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(bundle.tokenizer_path))
        except Exception as e:
            raise BundleError(f"{bundle.path}: corrupt bundle (cannot read {bundle.tokenizer_path.name}: "
                              f"{str(e).splitlines()[0][:120]})") from None
        self.special = bundle.special
        self.stop_ids = set(bundle.special.get("stop_token_ids") or [])
        self.template = None
        if bundle.chat_template:
            import jinja2.sandbox

            # the same environment Hugging Face uses to render chat templates
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(bundle.chat_template)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.template is None:  # no template: plain "role: content" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.special.get("bos_token") or "",
                                    eos_token=self.special.get("eos_token") or "")

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt))


def system_turn(system: str | None) -> list[dict]:
    """The conversation's opening: the system message, or nothing (the template's own default)."""
    return [{"role": "system", "content": system}] if system else []


def _raise(msg):
    raise EdgeKVError(f"chat template: {msg}")


class StreamDecoder:
    """Turns token ids into text as they come, never emitting half a UTF-8 character.

    Decodes a short window (from a prefix offset) instead of the whole text each step, and holds
    text back while it ends in U+FFFD (an incomplete byte sequence). `flush` emits what is left."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids up to here have been emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self.codec.decode(self.ids[self.prefix: self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            out = text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return out
        return ""

    def flush(self) -> str:
        prefix_text = self.codec.decode(self.ids[self.prefix: self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):]
