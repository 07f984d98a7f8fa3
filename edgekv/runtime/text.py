"""Tokenizer, chat template and streaming detokenization."""
from __future__ import annotations

import re
import threading
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
        self.enable_thinking = None  # the template's thinking mode when a render does not say (None: its default)
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

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               enable_thinking: bool | None = None) -> str:
        """enable_thinking: passed to the template (Qwen3's and SmolLM3's thinking mode) only
        when given (here or by with_thinking), so that None leaves the template's own default."""
        if self.template is None:  # no template: plain "role: content" lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        if enable_thinking is None:
            enable_thinking = self.enable_thinking
        extra = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
        return render_bounded(self.template, messages=messages, add_generation_prompt=add_generation_prompt,
                              bos_token=self.special.get("bos_token") or "", eos_token=self.special.get("eos_token") or "",
                              **extra)

    def with_thinking(self, enable: bool | None) -> "TextCodec":
        """A codec whose renders pass enable_thinking=`enable` unless told otherwise (chat --thinking off)."""
        import copy

        c = copy.copy(self)
        c.enable_thinking = enable
        return c

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                 enable_thinking: bool | None = None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt, enable_thinking))


def system_turn(system: str | None) -> list[dict]:
    """The conversation's opening: the system message, or nothing (the template's own default)."""
    return [{"role": "system", "content": system}] if system else []


# a chat template's rendering: at most this many characters out and this many seconds of work;
# no value it makes may be larger (characters, or a list's items and their characters), no list
# longer than the sandbox's range(), no number longer than MAX_INT_BITS
MAX_RENDER_CHARS = 4 << 20
MAX_RENDER_S = 5.0
MAX_ITEMS = 100_000
MAX_INT_BITS = 1 << 16


def bounded_sandbox():
    """Jinja's immutable sandbox with bounded work and bounded memory.

    Time: every call and attribute lookup checks the render's deadline (a template that loops
    without calling anything is bounded by the alarm, MAX_RENDER_CHARS and the sandbox's own
    range() limit). Memory: nothing is computed at compile time (jinja folds constant
    expressions when it compiles, before any runtime check: `'ab' * 10**9` took the memory at
    load), and whatever can make a large value from a short template is checked before it runs:
    the operators * ** % + (intercepted: a sandbox never folds those), ~ (the code generator's
    Concat), str methods that pad or join, the filters (their counts and widths, and what
    replace, join, indent, wordwrap and urlize would make) and every value output."""
    import jinja2.sandbox
    from jinja2.compiler import CodeGenerator

    class BoundedCode(CodeGenerator):
        def visit_Concat(self, node, frame):
            # a ~ b ~ c: the parts are sized before they are joined (a loop doubling a string stops)
            self.write("environment.join_parts(context, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(jinja2.sandbox.ImmutableSandboxedEnvironment):
        # each thread's render has its own deadline: a server renders on worker threads, and one
        # render ending must not lift another's bound
        _renders = threading.local()
        intercepted_binops = frozenset(["*", "**", "%", "+"])
        code_generator_class = BoundedCode

        def __init__(self, **kw):
            super().__init__(**kw, optimized=False, finalize=_checked)  # optimized: jinja's constant folding
            self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
            self.globals.pop("lipsum", None)  # lipsum(10**9): nothing a chat template needs

        def _tick(self):
            if time.monotonic() > getattr(self._renders, "deadline", float("inf")):
                raise EdgeKVError(f"chat template: rendering took longer than {MAX_RENDER_S:g} s")

        def call_binop(self, context, operator, left, right):
            if operator == "+" and type(left) is str and type(right) is str:  # templates' glue: kept fast
                _check_size(len(left) + len(right))
                return left + right
            self._tick()
            _check_binop(operator, left, right)  # sizes the result before it is computed
            return self.binop_table[operator](left, right)

        def join_parts(self, context, parts):
            from jinja2.runtime import markup_join, str_join

            _check_size(sum(_size(p) for p in parts))
            return (markup_join if context.eval_ctx.autoescape else str_join)(parts)

        def call(self, context, obj, *args, **kwargs):
            self._tick()
            _check_call(obj, args, kwargs)
            return _checked(super().call(context, obj, *args, **kwargs))

        def wrap_str_format(self, value):
            # jinja >= 3.1.5 hands out str.format wrapped at attribute access (call() sees the wrapper)
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = value.__self__

            def checked(*args, **kwargs):
                _check_widths(fmt, _BRACES, args + tuple(kwargs.values()))
                return wrapped(*args, **kwargs)
            return checked

        def getattr(self, obj, attribute):
            self._tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self._tick()
            return super().getitem(obj, argument)

    return Bounded


def _too_big(what: str = "a value"):
    raise EdgeKVError(f"chat template: makes {what} larger than {MAX_RENDER_CHARS} characters")


def _size(x, depth: int = 0) -> int:
    """About how many characters `x` renders to (a list: its items' and one per item), counted
    only until it passes MAX_RENDER_CHARS."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, int):
        return x.bit_length() * 3 // 10 + 1
    if isinstance(x, (list, tuple, dict)) and depth < 32:
        total = len(x)
        for item in (x.items() if isinstance(x, dict) else x):
            total += _size(item, depth + 1)
            if total > MAX_RENDER_CHARS:
                break
        return total
    return 1


def _check_size(n: int) -> None:
    if n > MAX_RENDER_CHARS:
        _too_big()


def _checked(value):
    """`value`, unless it is too large to make or to output."""
    if type(value) is str:  # most values: sized at once
        _check_size(len(value))
        return value
    if isinstance(value, (list, tuple)) and len(value) > MAX_ITEMS:
        raise EdgeKVError(f"chat template: makes a list of more than {MAX_ITEMS} items")
    _check_size(_size(value))
    return value


def _check_binop(op: str, a, b) -> None:
    """Refuse what `a op b` would make too large, before it is computed."""
    seqs = (str, list, tuple)
    if op == "*":
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, seqs) and isinstance(n, int):
                if not isinstance(seq, str) and len(seq) * n > MAX_ITEMS:
                    raise EdgeKVError(f"chat template: makes a list of more than {MAX_ITEMS} items")
                _check_size(_size(seq) * n)
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS:
            _too_big_number()
    elif op == "+" and isinstance(a, seqs) and isinstance(b, seqs):
        _check_size(_size(a) + _size(b))
    elif op == "**" and isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        if b * abs(a).bit_length() > MAX_INT_BITS:
            _too_big_number()
    elif op == "%" and isinstance(a, str):
        _check_widths(a, _PERCENT, b if isinstance(b, tuple) else (b,))


def _too_big_number():
    raise EdgeKVError(f"chat template: makes a number of more than {MAX_INT_BITS} bits")


_PERCENT = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")  # '%10.3f': width and precision
_BRACES = re.compile(r"\{[^{}]*?:((?:[^{}]|\{[^{}]*\})*)\}")  # '{:>10}': a field's spec (nested fields too)


def _check_widths(fmt: str, pattern, args) -> None:
    """A format string's widths and precisions (and a '*' or nested one's argument) stay in bounds."""
    for m in pattern.finditer(fmt):
        spec = m.group(0)
        if any(int(n) > MAX_RENDER_CHARS for n in re.findall(r"\d+", spec)):
            _too_big("a formatted field")
        if "*" in spec or spec.count("{") > 1:
            if any(isinstance(v, int) and v > MAX_RENDER_CHARS for v in args):
                _too_big("a formatted field")
    _check_size(len(fmt) + sum(_size(v) for v in args))


_PADDING = ("center", "ljust", "rjust", "zfill")


def _check_call(obj, args, kwargs) -> None:
    """A str method that pads, joins, replaces or formats: what it would make stays in bounds."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    values = args + tuple(kwargs.values())
    if name in _PADDING and any(isinstance(v, int) and v > MAX_RENDER_CHARS for v in values):
        _too_big()
    elif name == "expandtabs" and values and isinstance(values[0], int):
        _check_size(len(owner) + owner.count("\t") * values[0])
    elif name in ("format", "format_map"):
        _check_widths(owner, _BRACES, values)
    elif name == "replace" and len(args) >= 2:
        _check_size(_replaced_size(owner, args[0], args[1]))
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        _check_size(_size(args[0]) + len(owner) * len(args[0]))


def _replaced_size(s, old, new) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    return len(s) + (s.count(old) if old else len(s) + 1) * len(new)


def _bounded_filter(f):
    """A jinja filter whose arguments are checked first (counts and widths, and what the filters
    that grow their input would make) and whose result is checked after."""
    import functools

    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # eval context / environment first

    @functools.wraps(f)  # keeps jinja_pass_arg
    def bounded(*args, **kwargs):
        value, rest = (args[skip] if len(args) > skip else None), args[skip + 1:]
        if any(isinstance(v, int) and v > MAX_RENDER_CHARS for v in rest + tuple(kwargs.values())):
            _too_big()
        if f.__name__ in ("do_batch", "sync_do_batch", "do_slice", "sync_do_slice") and \
                any(isinstance(v, int) and v > MAX_ITEMS for v in rest[:1]):
            raise EdgeKVError(f"chat template: makes a list of more than {MAX_ITEMS} items")
        _check_growth(f.__name__, value, rest, kwargs)
        return _checked(f(*args, **kwargs))

    return bounded


def _check_growth(name: str, value, rest: tuple, kwargs: dict) -> None:
    """What the filters that can multiply their input's size would make, before they make it."""
    if name == "do_replace" and isinstance(value, str):
        _check_size(_replaced_size(value, _arg(rest, kwargs, 0, "old", ""), _arg(rest, kwargs, 1, "new", "")))
    elif name == "do_join" and isinstance(value, (list, tuple)):
        sep = _arg(rest, kwargs, 0, "d", "")
        _check_size(_size(value) + (len(sep) if isinstance(sep, str) else 0) * len(value))
    elif name == "do_indent" and isinstance(value, str):
        width = _arg(rest, kwargs, 0, "width", 4)
        w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _check_size(len(value) + (value.count("\n") + 1) * w)
    elif name == "do_wordwrap" and isinstance(value, str):
        width, wrap = _arg(rest, kwargs, 0, "width", 79), _arg(rest, kwargs, 2, "wrapstring", None)
        if isinstance(wrap, str) and isinstance(width, int) and width > 0:
            _check_size(len(value) + (len(value) // width + value.count("\n") + 1) * len(wrap))
    elif name == "do_format" and isinstance(value, str):
        _check_widths(value, _PERCENT, rest + tuple(kwargs.values()))


def _arg(rest: tuple, kwargs: dict, i: int, name: str, default):
    """A filter's argument after its value: positional `i` or keyword `name`."""
    return rest[i] if len(rest) > i else kwargs.get(name, default)


def render_bounded(template, **ctx) -> str:
    """Render `template`, stopping with one error line past MAX_RENDER_CHARS or MAX_RENDER_S."""
    import jinja2

    env = template.environment
    env._renders.deadline = time.monotonic() + MAX_RENDER_S
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
        env._renders.deadline = float("inf")
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
