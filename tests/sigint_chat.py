"""Runs `edgekv chat` with a slowed backend and a small prefill chunk, so a test can send a real
SIGINT in the middle of a multi-chunk prefill or of a decode (tests/test_hardening.py).

Each graph call prints `CALL <kind> <n>` on stderr before it runs (kind: prefill or decode, n:
its number in this turn), then sleeps SLOW seconds for turns whose message starts with "SLOW"."""
import signal
import sys
import time

from edgekv.cli import main
from edgekv.runtime import assemble
from edgekv.runtime.backends.ort import OrtBackend

CHUNK, SLOW = 8, 0.25
turn = {"slow": False, "prefill": 0, "decode": 0}
_batcher, _run = assemble.Runtime.batcher, OrtBackend.run_cells


def batcher(self, capacity=None, **kw):
    return _batcher(self, capacity, **{**kw, "prefill_chunk": CHUNK})


def run(self, cache, past, write, ids, *rest):
    kind = "prefill" if ids.shape[1] > 1 else "decode"
    turn[kind] += 1
    if turn["slow"]:
        print(f"CALL {kind} {turn[kind]}", file=sys.stderr, flush=True)
        time.sleep(SLOW)
    return _run(self, cache, past, write, ids, *rest)


_input = input


def read_line(prompt=""):
    line = _input(prompt)
    turn.update(slow=line.startswith("SLOW"), prefill=0, decode=0)
    return line


# a shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT ignored:
# take Ctrl-C as KeyboardInterrupt whatever the test runner was started from
signal.signal(signal.SIGINT, signal.default_int_handler)
assemble.Runtime.batcher = batcher
OrtBackend.run_cells = run
import builtins  # noqa: E402

builtins.input = read_line
sys.exit(main(["chat", *sys.argv[1:]]))
