"""The host under `edgekv bench`: this process's memory, the memory's read bandwidth, and
--neighbour, processes beside the timing as a Jetson's camera or ROS pipelines run beside the
model: `steady` keeps one core busy all the time, `bursty` every core 0.2 s in each 0.5 s
(another job's bursts). They run for the whole bench, edgekv's timing and llama.cpp's alike, so
the ratio of the two is taken beside the same neighbour."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np

from edgekv.runtime.memory import PROC_STATUS, kib_field

NEIGHBOURS = ("none", "steady", "bursty")
BURST_S, PERIOD_S = 0.2, 0.5
BURST = ("import time\n"
         "while True:\n"
         "    t = time.monotonic()\n"
         f"    while time.monotonic() - t < {BURST_S}:\n"
         "        pass\n"
         f"    time.sleep({PERIOD_S - BURST_S})\n")
STEADY = "while True:\n    pass\n"


def rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process, from /proc (no psutil needed on the device)."""
    return kib_field(PROC_STATUS, "VmRSS") or 0, kib_field(PROC_STATUS, "VmHWM") or 0


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """Bytes/s for a streaming read of a buffer far larger than cache, split over `threads`
    threads (numpy's reductions release the GIL). The yardstick for bandwidth-bound decode."""
    a = np.ones(nbytes // 4, np.float32)
    parts = np.array_split(a, threads)
    best = 0.0
    for _ in range(repeat):
        ths = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        best = max(best, a.nbytes / (time.perf_counter() - t0))
    del a, parts
    return best


SAID = {"steady": "one core kept busy", "bursty": f"every core busy {BURST_S:g} s in each {PERIOD_S:g} s"}


@contextmanager
def neighbour(kind: str):
    """Run the neighbour `kind` around the block: its processes (one a core), killed and reaped on leaving."""
    if kind == "none":
        yield []
        return
    n, code = (1, STEADY) if kind == "steady" else (os.cpu_count() or 1, BURST)
    procs = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
