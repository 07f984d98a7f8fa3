"""Request fields, checked: the JSON body, numbers, flags, text, sampling, stop strings, the
fields refused until implemented. Every bad value is one ApiError (a 400 naming the field)."""
from __future__ import annotations

import json
from typing import Callable

from edgekv.runtime.sampling import SamplingDefaults, SamplingParams
from edgekv.runtime.text import TextCodec
from edgekv.serve.api import ApiError

MAX_STOP = 4  # stop sequences per request, as OpenAI's API
# nginx's default client_max_body_size: a 32k-token context of text fits even as \u-escaped JSON,
# and a hostile body of nested empty lists (the worst case, ~20x its size once parsed) stays ~20 MB
MAX_BODY_BYTES = 1 << 20


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; every way json.loads can fail is a 400 (ValueError covers bad
    UTF-8 and integers past Python's digit limit, RecursionError deep nesting)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{name}' must be {kind} in [{lo}, {hi}] (got {str(v)[:40]})", param=name)
    return v


def flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be true, false or null", param=name)
    return bool(v)


def text(s, param: str) -> str:
    """A string the tokenizer can take: a lone surrogate ("\\udcff" in JSON) is not UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' holds a lone surrogate (not valid Unicode text)", param=param) from None
    return s


def seed_of(body: dict) -> int | None:
    """Any 64-bit seed, as OpenAI takes; a negative one is read as its unsigned 64-bit pattern
    (distinct seeds stay distinct; numpy's generator takes only non-negative seeds)."""
    seed = number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    return None if seed is None else seed & ((1 << 64) - 1)


def sampling_of(body: dict, unset: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """A request's sampling; what it leaves unset comes from the server's defaults (the model's)."""
    return SamplingParams(temperature=float(number(body, "temperature", unset.temperature, 0.0, 2.0)),
                          top_p=float(number(body, "top_p", unset.top_p, 0.0, 1.0)),
                          top_k=int(number(body, "top_k", unset.top_k, 0, 1 << 20, integer=True)),
                          repeat_penalty=float(number(body, "repeat_penalty", unset.repeat_penalty, 0.1, 10.0)),
                          seed=seed_of(body))


def stops_of(body: dict, name: str = "stop", limit: int = MAX_STOP) -> list[str]:
    stop = body.get(name)
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) and name == "stop" else stop
    if not isinstance(stops, list) or len(stops) > limit or not all(isinstance(s, str) and s for s in stops):
        one = "a string or " if name == "stop" else ""
        raise ApiError(400, f"'{name}' must be {one}a list of up to {limit} non-empty strings", param=name)
    return [text(s, name) for s in stops]


def max_tokens_of(body: dict) -> int:
    cap = number(body, "max_completion_tokens", None, 1, 1 << 20, integer=True)
    return number(body, "max_tokens", cap or 256, 1, 1 << 20, integer=True)


def prompt_of(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    return text(prompt, "prompt")


# -- fields that would change the answer but are not implemented: refused until they are, so a
# client that asks for JSON or a tool call is told instead of getting prose. field -> (is the
# value harmless, what is accepted)
def absent_or(*ok) -> Callable[[object], bool]:
    return lambda v: v is None or any(v == o and type(v) is type(o) for o in ok)


COMMON_UNSUPPORTED = {
    "n": (absent_or(1), "1 or null: one sequence per request"),
    "logit_bias": (absent_or({}), "{} or null"),
    "presence_penalty": (absent_or(0, 0.0), "0 or null"),
    "frequency_penalty": (absent_or(0, 0.0), "0 or null"),
}
CHAT_UNSUPPORTED = COMMON_UNSUPPORTED | {  # tools, response_format, logprobs: edgekv/serve/tools.py, structured.py
    "functions": (absent_or([]), "[] or null (use 'tools')"),
    "function_call": (absent_or("none"), '"none" or null (use \'tool_choice\')'),
}
COMPLETION_UNSUPPORTED = COMMON_UNSUPPORTED | {
    "echo": (absent_or(False), "false or null"),
    "suffix": (absent_or(""), '"" or null'),
    "best_of": (absent_or(1), "1 or null"),
}
# fields that need the grammar tokenizer (llguidance): plain requests never build it
STRUCTURED_FIELDS = ("tools", "tool_choice", "response_format", "logprobs", "top_logprobs")


def refuse_unsupported(body: dict, table: dict) -> None:
    for name, (harmless, accepted) in table.items():
        if not harmless(body.get(name)):
            raise ApiError(400, f"'{name}' is not supported yet (only {accepted})", param=name,
                           code="unsupported_parameter")


# chat_template_kwargs a client may send (vLLM's field): name -> the type its value must have
TEMPLATE_KWARGS = {"enable_thinking": bool}


def template_kwargs_of(body: dict) -> dict:
    """chat_template_kwargs, as vLLM takes it: an object of the keys above (others are a 400
    naming them: a template variable the server does not know is never passed on)."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object or null", param="chat_template_kwargs")
    unknown = sorted(k for k in kw if k not in TEMPLATE_KWARGS)
    if unknown:
        raise ApiError(400, f"'chat_template_kwargs' takes only {', '.join(TEMPLATE_KWARGS)}; not "
                            f"{', '.join(repr(k[:40]) for k in unknown[:8])}", param="chat_template_kwargs",
                       code="unsupported_parameter")
    for k, v in kw.items():
        if v is not None and type(v) is not TEMPLATE_KWARGS[k]:
            raise ApiError(400, f"chat_template_kwargs.{k} must be true, false or null", param="chat_template_kwargs")
    return {k: v for k, v in kw.items() if v is not None}


def include_usage_of(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise ApiError(400, "'stream_options' must be an object or null", param="stream_options")
    return flag(so, "include_usage")


def encode_unlocked(codec: TextCodec, text: str) -> list[int]:
    """codec.encode(text), through the tokenizer's batch call, which releases the GIL while it
    works (its encode holds it: 150k characters kept /health waiting ~0.5 s even off the loop)."""
    return codec.tok.encode_batch([text], add_special_tokens=False)[0].ids


def max_token_chars(codec: TextCodec) -> int:
    """An upper bound on the characters one token stands for: its vocabulary string's length (a
    byte-level string has one symbol per byte); x4 where a normalizer may merge characters."""
    longest = max((len(t) for t in codec.tok.get_vocab()), default=1)
    return longest * (4 if codec.tok.normalizer is not None else 1)
