"""What a device offers edgekv: JetPack / L4T, TensorRT, CUDA, onnxruntime providers, memory.

    python -m jetson.env_check [--json]

Runs anywhere (a workstation prints what is missing). The first part of the Jetson self-test
(jetson/selftest.sh; docs/tensorrt.md)."""
from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path


def l4t_release() -> str | None:
    """JetPack's L4T release from /etc/nv_tegra_release, e.g. 'R36.3.0' (JetPack 6.0)."""
    p = Path("/etc/nv_tegra_release")
    if not p.is_file():
        return None
    m = re.search(r"R(\d+).*REVISION:\s*([\d.]+)", p.read_text())
    return f"R{m.group(1)}.{m.group(2)}" if m else p.read_text().strip()[:60]


def module_version(name: str) -> str | None:
    try:
        mod = __import__(name)
    except Exception:
        return None
    return getattr(mod, "__version__", "?")


def cuda_version() -> str | None:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release ([\d.]+)", out)
        if m:
            return m.group(1)
    v = Path("/usr/local/cuda/version.json")
    if v.is_file():
        return json.loads(v.read_text()).get("cuda", {}).get("version")
    return None


def memory() -> dict:
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                info[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return info


def ort_providers() -> list[str]:
    try:
        import onnxruntime as ort

        return ort.get_available_providers()
    except Exception:
        return []


def report() -> dict:
    mem = memory()
    return {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "l4t": l4t_release(),
        "tensorrt": module_version("tensorrt"),
        "cuda": cuda_version(),
        "onnxruntime": module_version("onnxruntime"),
        "onnxruntime_providers": ort_providers(),
        "mem_total_mib": round(mem.get("MemTotal", 0) / 2**20),
        "mem_available_mib": round(mem.get("MemAvailable", 0) / 2**20),
    }


def main(argv=None) -> int:
    r = report()
    if "--json" in (argv if argv is not None else sys.argv[1:]):
        print(json.dumps(r))
        return 0
    missing = "not found"
    print(f"machine      {r['machine']}, Python {r['python']}")
    print(f"L4T/JetPack  {r['l4t'] or 'not a Jetson (no /etc/nv_tegra_release)'}")
    print(f"TensorRT     {r['tensorrt'] or missing}")
    print(f"CUDA         {r['cuda'] or missing}")
    print(f"onnxruntime  {r['onnxruntime'] or missing}  providers: {', '.join(r['onnxruntime_providers']) or '-'}")
    print(f"memory       {r['mem_available_mib']} MiB available of {r['mem_total_mib']} MiB"
          + ("  (shared by CPU and GPU on a Jetson)" if r["l4t"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
