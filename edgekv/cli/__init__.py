"""The `edgekv` command. Errors meant for the user print as one line and exit non-zero. The
parser is built in edgekv/cli/parsers.py (one function per command) from edgekv/cli/args.py's
types and shared option groups; here: dispatch to each command's module, by name."""
from __future__ import annotations

import importlib
import sys

from edgekv.cli.parsers import build_parser
from edgekv.errors import EdgeKVError

# the setting a library error names (EdgeKVError.setting) -> the flag that changes it
FLAGS = {"capacity": "--ctx", "context_policy": "--context", "max_context": "--max-context",
         "max_prefill": "--max-prefill", "prefix_windows": "--prefix-windows"}


def explain(e: EdgeKVError) -> str:
    """An error's one line, its fix naming the flag."""
    return e.explain(FLAGS)


# command -> (module, function), imported only when run: `edgekv chat` never loads the exporter.
# export/ and jetson/ import edgekv, never the reverse: the CLI reaches them only by name, here.
COMMANDS = {
    "export": ("export.pipeline", "cmd_export"),
    "generate": ("edgekv.tools.generate", "cmd_generate"),
    "chat": ("edgekv.chat.terminal", "cmd_chat"),
    "eval": ("edgekv.tools.evaluate", "cmd_eval"),
    "eval-context": ("edgekv.tools.context_eval", "cmd_eval_context"),
    "check-trt": ("edgekv.tools.trt_check", "cmd_check_trt"),
    "build-engine": ("jetson.build_engine", "cmd_build_engine"),
    "bench": ("edgekv.tools.bench", "cmd_bench"),
    "serve": ("edgekv.serve.server", "cmd_serve"),
    "bench-serve": ("edgekv.serve.bench", "cmd_bench_serve"),
    "verify": ("edgekv.tools.verify", "cmd_verify"),
}
# commands that go on after an error (chat's slash commands) print it themselves: they get `explain`
REPORTS_ERRORS = {"chat"}
# a command's module that needs a pip extra -> that extra
EXTRAS = {"export.pipeline": "export"}


def load_command(name: str):
    module, func = COMMANDS[name]
    try:
        return getattr(importlib.import_module(module), func)
    except ImportError as e:
        if module not in EXTRAS:
            raise
        raise EdgeKVError(f"{name} needs the exporter's dependencies ({e.name} missing): "
                          f"pip install -e '.[{EXTRAS[module]}]'") from None


# arguments that are text for the model (not paths): they must be valid UTF-8
TEXT_ARGS = ("prompt", "system")


def undecodable(args) -> str | None:
    """The first text argument holding bytes that are not UTF-8 (Python keeps them as surrogates)."""
    for name in TEXT_ARGS:
        v = getattr(args, name, None)
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return name
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if bad := undecodable(args):
        print(f"edgekv {args.cmd}: error: the {bad} is not valid UTF-8 text", file=sys.stderr)
        return 2
    try:
        command = load_command(args.cmd)
        return command(args, explain) if args.cmd in REPORTS_ERRORS else command(args)
    except EdgeKVError as e:
        print(f"edgekv {args.cmd}: error: {explain(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nedgekv {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
