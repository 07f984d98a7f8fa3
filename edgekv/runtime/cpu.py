"""The host CPU, named in every benchmark output, and the llama.cpp build flags it runs
(llama-cpp-python's CMAKE_ARGS). Stdlib only: the CLI's parser imports it. Every function takes
/proc/cpuinfo's text (default: this host's) so tests can feed another CPU's.

  python -m edgekv.runtime.cpu               this CPU and its CMAKE_ARGS
  python -m edgekv.runtime.cpu --cmake-args  just the flags: CMAKE_ARGS="$(python -m edgekv.runtime.cpu --cmake-args)"
"""
from __future__ import annotations

import functools
import platform
import sys

ISA_LEVELS = ("avx512-vnni", "avx512", "avx2", "x86-64", "neon-dotprod", "neon")

# ARM's CPU part numbers (implementer 0x41) of the cores edgekv meets; NVIDIA's (0x4e) Carmel
ARM_PARTS = {"0xd03": "Cortex-A53", "0xd04": "Cortex-A35", "0xd05": "Cortex-A55", "0xd07": "Cortex-A57",
             "0xd08": "Cortex-A72", "0xd09": "Cortex-A73", "0xd0a": "Cortex-A75", "0xd0b": "Cortex-A76",
             "0xd0c": "Neoverse-N1", "0xd0d": "Cortex-A77", "0xd40": "Neoverse-V1", "0xd41": "Cortex-A78",
             "0xd42": "Cortex-A78AE", "0xd44": "Cortex-X1", "0xd46": "Cortex-A510", "0xd47": "Cortex-A710",
             "0xd48": "Cortex-X2", "0xd49": "Neoverse-N2", "0xd4b": "Cortex-A78C", "0xd4f": "Neoverse-V2"}
IMPLEMENTERS = {"0x41": "ARM", "0x4e": "NVIDIA", "0x51": "Qualcomm", "0x61": "Apple", "0xc0": "Ampere"}
NVIDIA_PARTS = {"0x004": "Carmel"}

# x86 options GGML_NATIVE=OFF turns ON by itself (ggml/CMakeLists.txt, INS_ENB): named ON or OFF,
# so a CPU without one gets OFF (a build with it would die of SIGILL)
X86_DEFAULT_ON = (("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("bmi2", "BMI2"))
# AVX and SSE 4.2 are implied by AVX2 (-mavx2); named only on a CPU without AVX2
X86_PRE_AVX2 = (("avx", "AVX"), ("sse4_2", "SSE42"))
# off unless named: ON only where /proc/cpuinfo lists them. Never AMX: VMs report AMX they do not enable
AVX512_BASE = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}  # what GGML_AVX512 compiles for
AVX512_EXTRAS = (("avx512vbmi", "AVX512_VBMI"), ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16"))


@functools.lru_cache(maxsize=1)
def host_cpuinfo() -> str:
    """This host's /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _fields(cpuinfo: str | None) -> dict[str, list[str]]:
    """key (lower case) -> its values in order, one per processor block where it repeats."""
    out: dict[str, list[str]] = {}
    for line in (host_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip().lower(), []).append(value.strip())
    return out


def _first(f: dict, key: str) -> str:
    return (f.get(key) or [""])[0]


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first CPU's instruction-set flags: x86's `flags`, aarch64's `Features`."""
    f = _fields(cpuinfo)
    return set((_first(f, "flags") or _first(f, "features")).split())


def is_arm(cpuinfo: str | None = None) -> bool:
    """aarch64: its cpuinfo lists `Features` and `CPU implementer`; without a cpuinfo, the machine."""
    f = _fields(cpuinfo)
    if "flags" in f or "features" in f:
        return "flags" not in f
    return platform.machine().lower() in ("aarch64", "arm64")


def isa_level(cpuinfo: str | None = None) -> str:
    """The highest of ISA_LEVELS the CPU lists."""
    flags = cpu_flags(cpuinfo)
    if is_arm(cpuinfo):
        return "neon-dotprod" if "asimddp" in flags else "neon"
    if "avx512f" in flags:
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    return "avx2" if "avx2" in flags else "x86-64"


def _arm_name(f: dict) -> str:
    """aarch64: the cores by CPU part (distinct, in order: 'Cortex-A78AE' or 'Cortex-A76+Cortex-A55'),
    then the board where the kernel names it (Hardware / Model)."""
    cores = []
    for imp, part in zip(f.get("cpu implementer", []), f.get("cpu part", [])):
        known = ARM_PARTS.get(part) if imp == "0x41" else NVIDIA_PARTS.get(part) if imp == "0x4e" else None
        name = known or f"{IMPLEMENTERS.get(imp, 'implementer ' + imp)} part {part}"
        if name not in cores:
            cores.append(name)
    board = _first(f, "hardware") or _first(f, "model")
    name = "+".join(cores) or platform.processor()
    return f"{name} ({board})" if name and board else name or board


def model_name(cpuinfo: str | None = None) -> str:
    """The CPU's name: x86's `model name`; aarch64's cores and board; else platform.processor()."""
    f = _fields(cpuinfo)
    name = _first(f, "model name") if not is_arm(cpuinfo) else ""
    return " ".join((name or _arm_name(f) or platform.processor() or "unknown CPU").split())


def cpu_field(threads: int | None, cpuinfo: str | None = None) -> dict:
    """The `cpu` field of a benchmark's JSON."""
    return {"model": model_name(cpuinfo), "isa": isa_level(cpuinfo), "threads": threads}


def describe(threads: int | None, cpuinfo: str | None = None) -> str:
    """One line: 'Intel Xeon ... (avx512-vnni), 2 threads'."""
    line = f"{model_name(cpuinfo)} ({isa_level(cpuinfo)})"
    return f"{line}, {threads} thread{'s' if threads != 1 else ''}" if threads else line


def _arm_march(flags: set[str]) -> str | None:
    """-march for ggml's ARM kernels: dotprod (+fp16, +i8mm) where listed; None: the armv8-a
    baseline (NEON, which every aarch64 CPU has)."""
    if "asimddp" not in flags:
        return None
    extras = ("+fp16" if {"asimdhp", "fphp"} <= flags else "") + ("+i8mm" if "i8mm" in flags else "")
    return f"armv8.2-a+dotprod{extras}"


def llama_cpp_cmake_args(cpuinfo: str | None = None) -> str:
    """llama-cpp-python's CMAKE_ARGS for this CPU: never GGML_NATIVE (a CPU that reports AMX its VM
    does not enable makes a native build die of SIGILL, docs/benchmarks.md), each instruction set
    named from /proc/cpuinfo. aarch64: GGML_CPU_ARM_ARCH (a llama.cpp older than the option
    ignores it and builds for armv8-a, slower but safe)."""
    flags, args = cpu_flags(cpuinfo), ["-DGGML_NATIVE=OFF"]
    if is_arm(cpuinfo):
        march = _arm_march(flags)
        return " ".join(args + ([f"-DGGML_CPU_ARM_ARCH={march}"] if march else []))
    args += [f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in X86_DEFAULT_ON]
    if "avx2" not in flags:
        args += [f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in X86_PRE_AVX2]
    if AVX512_BASE <= flags:
        args += ["-DGGML_AVX512=ON"] + [f"-DGGML_{opt}=ON" for flag, opt in AVX512_EXTRAS if flag in flags]
    if "avx_vnni" in flags and "avx2" in flags:
        args.append("-DGGML_AVX_VNNI=ON")
    return " ".join(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--cmake-args"]:
        print(llama_cpp_cmake_args())
        return 0
    if argv:
        print("usage: python -m edgekv.runtime.cpu [--cmake-args]", file=sys.stderr)
        return 2
    print(f"cpu: {describe(None)}")
    print(f'CMAKE_ARGS="{llama_cpp_cmake_args()}" pip install "edgekv[bench]"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
