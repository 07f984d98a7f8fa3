"""Tokenizer, chat template and streaming detokenization."""
from __future__ import annotations

import time

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
            import jinja2

            # the same sandbox Hugging Face renders chat templates in, with bounded work
            env = bounded_sandbox()(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self.template = env.from_string(bundle.chat_template)
            except jinja2.TemplateError as e:
                raise BundleError(f"{bundle.path}: bad chat template ({str(e).splitlines()[0][:120]})") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.template is None:  # no template: plain "role: content" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        return render_bounded(self.template, messages=messages, add_generation_prompt=add_generation_prompt,
                              bos_token=self.special.get("bos_token") or "", eos_token=self.special.get("eos_token") or "")

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt))


def system_turn(system: str | None) -> list[dict]:
    """The conversation's opening: the system message, or nothing (the template's own default)."""
    return [{"role": "system", "content": system}] if system else []


# a chat template's rendering: at most this many characters out and this many seconds of work
MAX_RENDER_CHARS = 4 << 20
MAX_RENDER_S = 5.0


def bounded_sandbox():
    """Jinja's immutable sandbox whose every call and attribute lookup checks the render's
    deadline (a template that loops without calling anything is bounded by MAX_RENDER_CHARS
    and the sandbox's own range() limit)."""
    import jinja2.sandbox

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        deadline = float("inf")

        def _tick(self):
            if time.monotonic() > self.deadline:
                raise EdgeKVError(f"chat template: rendering took longer than {MAX_RENDER_S:g} s")

        def call(self, context, obj, *args, **kwargs):
            self._tick()
            return super().call(context, obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            self._tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self._tick()
            return super().getitem(obj, argument)

    return Bounded


def render_bounded(template, **ctx) -> str:
    """Render `template`, stopping with one error line past MAX_RENDER_CHARS or MAX_RENDER_S."""
    import jinja2

    env = template.environment
    env.deadline = time.monotonic() + MAX_RENDER_S
    out, size = [], 0
    alarm = _Alarm(MAX_RENDER_S)  # also stops loops that call nothing (main thread only)
    try:
        for piece in template.generate(**ctx):
            size += len(piece)
            if size > MAX_RENDER_CHARS:
                raise EdgeKVError(f"chat template: rendered more than {MAX_RENDER_CHARS} characters")
            env._tick()
            out.append(piece)
    except _Timeout:
        raise EdgeKVError(f"chat template: rendering took longer than {MAX_RENDER_S:g} s") from None
    except jinja2.TemplateError as e:  # the sandbox's SecurityError included
        raise EdgeKVError(f"chat template: {str(e).splitlines()[0][:160]}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
            RecursionError) as e:
        raise EdgeKVError(f"chat template: {type(e).__name__}: {str(e)[:120]}") from None
    finally:
        alarm.cancel()
        env.deadline = float("inf")
    return "".join(out)


class _Timeout(Exception):
    pass


class _Alarm:
    """SIGALRM after `seconds`, raising _Timeout in the main thread; the previous handler is
    put back by `cancel` (elsewhere than the main thread it does nothing: the deadline checks
    in Bounded.call/getattr/getitem remain)."""

    def __init__(self, seconds: float):
        import signal
        import threading

        self.old = None
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, seconds)

    @staticmethod
    def _fire(signum, frame):
        raise _Timeout()

    def cancel(self) -> None:
        import signal

        if self.old is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
            self.old = None


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
