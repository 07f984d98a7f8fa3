"""The AVX2-only class of x86 (an AMD EPYC without AVX-512) on any x86 host: tests/rows_check.py
run under qemu-user as an EPYC-Rome, whose CPUID onnxruntime reads, so MLAS dispatches its AVX2
kernels (among them the one-row 4-bit MatMulNBits kernel that made a lone decode differ from a
batched one; docs/weights.md). On an AVX2 host the rest of the suite covers this natively too.
qemu-user >= 8 (bookworm's 7.2 mis-executes numpy's AVX2 code): `bash .ci/qemu_user.sh` fetches
Debian trixie's into ~/.cache/edgekv/qemu, which .ci/run does; EDGEKV_QEMU_X86 names another."""
from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QEMU_CPU = "EPYC-Rome"  # AVX2, FMA, F16C; no AVX-512


@functools.lru_cache(maxsize=None)  # asked at collection and by each run: one `--version` a process
def find_qemu() -> str | None:
    for cand in (os.environ.get("EDGEKV_QEMU_X86"), str(Path.home() / ".cache/edgekv/qemu/usr/bin/qemu-x86_64"),
                 shutil.which("qemu-x86_64")):
        if cand and os.access(cand, os.X_OK):
            v = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
            m = re.search(r"version (\d+)", v)
            if m and int(m.group(1)) >= 8:
                return cand
    return None


pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 emulation of an x86 host"),
    pytest.mark.skipif(find_qemu() is None, reason="qemu-user >= 8 not found: bash .ci/qemu_user.sh (CI runs it)"),
]


def run_emulated(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([find_qemu(), "-cpu", QEMU_CPU, sys.executable, "-m", "tests.rows_check", *args],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_avx2_batched_equals_alone_on_4bit_weights(tiny_gguf_bundles):
    """On the emulated AVX2 CPU the probe finds the one-row 4-bit kernel and pads it; then every
    sequence of the pool's schedule and of serve's fused slots equals its lone decode bit for bit.
    Without the pass the same run differs (the emulation really dispatches that kernel)."""
    bundles = (str(tiny_gguf_bundles("int8")), str(tiny_gguf_bundles("int8-static")))
    got = run_emulated(*bundles)
    assert got["exact"] and any(k.startswith("4-bit") for k in got["padded"]), got
    assert all(got["pool"].values()), got
    assert got.get("slots") is None or all(got["slots"].values()), got
    unpadded = run_emulated(*bundles, "--no-pad")
    assert not all(unpadded["pool"].values()), unpadded
