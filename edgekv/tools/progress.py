"""Progress on stderr for the long steps that print nothing of their own (torch.export, the
export's parity check, a benchmark's rounds): a line when a stage starts, one every `every`
seconds while it runs with the time so far, and one with its time when it ends. stdout stays
the command's answer."""
from __future__ import annotations

import contextlib
import threading
import time

from edgekv.errors import note

HEARTBEAT_S = 30.0  # long enough not to clutter, short enough that nobody wonders whether it hangs


@contextlib.contextmanager
def stage(what: str, detail: str = "", every: float = HEARTBEAT_S, say=note):
    """`with stage("exporting ONNX", " (kv=int8)"):` prints "exporting ONNX (kv=int8) ...", then
    "  ... exporting ONNX: 30 s" while the block runs, then "  exporting ONNX: done in 95.2 s"
    (nothing more if it raised: the error is the news)."""
    start = time.monotonic()
    say(f"{what}{detail} ...")
    done = threading.Event()

    def beat():
        while not done.wait(every):
            say(f"  ... {what}: {time.monotonic() - start:.0f} s")

    ticker = threading.Thread(target=beat, name="edgekv-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    say(f"  {what}: done in {time.monotonic() - start:.1f} s")
