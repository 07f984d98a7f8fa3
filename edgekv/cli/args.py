"""The command line's building blocks: the help formatter, the one-line error parser, the
argument types (bounded integers and numbers, lists, KV schemes) and the option groups that several
commands share (sampling, runtime)."""
from __future__ import annotations

import argparse
import math

from edgekv.format.bundle import LIMITS
from edgekv.format.kvschemes import get_scheme
from edgekv.runtime.backends import BACKENDS


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option shows its default (unless its help already says what it is)."""

    def _get_help_string(self, action):
        h = action.help or ""
        if (action.option_strings and action.default is not argparse.SUPPRESS and "default" not in h
                and not isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction))):
            h += (" " if h else "") + "(default: %(default)s)"
        return h


class Parser(argparse.ArgumentParser):
    """Bad arguments: one line (the command, the problem, where help is), exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_range(lo: int, hi: int):
    """An argparse type: an integer in lo..hi (the message says the range)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in {lo}..{hi} (got {text[:40]!r})")
        return v
    parse.__name__ = "integer"
    return parse


def float_range(lo: float, hi: float, lo_open: bool = False):
    """An argparse type: a finite number in lo..hi (above lo if lo_open)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or not (lo < v if lo_open else lo <= v) or v > hi:
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"must be a number in {interval} (got {text[:40]!r})")
        return v
    parse.__name__ = "number"
    return parse


def int_list(lo: int, hi: int):
    """An argparse type: comma-separated integers, each in lo..hi."""
    one = int_range(lo, hi)

    def parse(text: str) -> list[int]:
        try:
            return [one(x.strip()) for x in text.split(",")]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be comma-separated integers in {lo}..{hi} "
                                             f"(got {text[:40]!r})") from None
    parse.__name__ = "list"
    return parse


# the ranges flags take: counts of tokens are bounded by the largest context a manifest may declare
TOKENS = LIMITS["max_context"]
THREADS = int_range(1, 1024)
CTX = int_range(1, TOKENS)


def kv_scheme(name: str) -> str:
    """--kv: a scheme of the code's own table (the table's own error for any other name)."""
    if name == "auto":  # export's default: int8-static where its held-out check holds (export/kv_gate.py)
        return name
    try:
        return get_scheme(name).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# the sampling flags default to None, "unset": the bundle's own defaults (its manifest's `sampling`,
# recorded at export: edgekv/runtime/sampling.py's defaults_of), as a serve request that sets none
MODEL_DEFAULT = "default: the model's, from its manifest; the load line says which"


def add_sampling(p, serve: bool = False):
    """--temperature, --top-k, --top-p, --repeat-penalty (unset: the model's); generate and chat
    also --repeat-last-n and --seed. serve: the flags set what a request that leaves them unset gets."""
    p.add_argument("--temperature", type=float_range(0, 100), default=None, help=f"0 = greedy ({MODEL_DEFAULT})")
    p.add_argument("--top-k", type=int_range(0, LIMITS["vocab_size"]), default=None,
                   help=f"keep the k most likely tokens, 0 = off ({MODEL_DEFAULT})")
    p.add_argument("--top-p", type=float_range(0, 1, lo_open=True), default=None,
                   help=f"nucleus sampling mass, 1 = off ({MODEL_DEFAULT})")
    p.add_argument("--repeat-penalty", type=float_range(0, 100, lo_open=True), default=None,
                   help=f"divide logits of recent tokens, 1 = off ({MODEL_DEFAULT})")
    if serve:
        return
    p.add_argument("--repeat-last-n", type=int_range(0, TOKENS), default=64,
                   help="recent tokens the repeat penalty looks at (0 = off)")
    p.add_argument("--seed", type=int_range(0, 2**63 - 1), default=None, help="sampling seed (default: random each run)")


def add_runtime(p, ctx_help: str = "KV cache capacity in tokens (default: min(2048, bundle max))"):
    p.add_argument("--ctx", type=CTX, default=None, help=ctx_help)
    p.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="auto = trt if an engine is built, else ort-cuda if onnxruntime has CUDA, else ort-cpu (ort-cpu runs a static int8 cache through onnxruntime's fused GroupQueryAttention, EDGEKV_ATTENTION=plain: the graph as written; the graph as written sums attention in exact fixed point so that temperature 0 does not depend on batching or the prefix cache; EDGEKV_EXACT=0 runs it as written: faster prefill, less memory; README)")
    p.add_argument("--threads", type=THREADS, default=None, help="CPU threads (default: OMP_NUM_THREADS where set, else every CPU available)")
