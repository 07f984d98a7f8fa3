"""The CPU a benchmark ran on (edgekv/runtime/cpu.py): its name and ISA level from /proc/cpuinfo
texts of three kinds of host, the llama.cpp CMAKE_ARGS each can run, and the `cpu` field and
line that bench, llama_cpp_bench, bench-serve and eval write."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgekv.runtime import cpu
from edgekv.runtime.cpu import cpu_field, describe, isa_level, llama_cpp_cmake_args, model_name
from tests.conftest import ROOT, run_edgekv

X86_BASE = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
            "syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid pni pclmulqdq ssse3 fma cx16 "
            "sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm abm bmi1 avx2 smep "
            "bmi2 erms adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves")


def x86_cpuinfo(model: str, flags: str, n: int = 2) -> str:
    return "\n".join(f"processor\t: {i}\nvendor_id\t: X\ncpu family\t: 23\nmodel name\t: {model}\n"
                     f"flags\t\t: {flags}\nbogomips\t: 4899.99\n" for i in range(n))


# a Zen 2 EPYC: AVX2, no AVX-512
EPYC = x86_cpuinfo("AMD EPYC 7B12", X86_BASE + " sse4a misalignsse topoext")
# a Cascade Lake Xeon: AVX-512 with VNNI, no BF16, no AVX-VNNI
XEON = x86_cpuinfo("Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz",
                   X86_BASE + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni")
# a Sandy Bridge Xeon: AVX, no AVX2, FMA, F16C or BMI2
SANDY = x86_cpuinfo("Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz",
                    "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt aes xsave avx hypervisor lahf_lm")


def arm_cpuinfo(features: str, part: str, n: int = 2, tail: str = "") -> str:
    blocks = [f"processor\t: {i}\nBogoMIPS\t: 62.50\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
              f"CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: {part}\nCPU revision\t: 1\n" for i in range(n)]
    return "\n".join(blocks) + tail


# Jetson Orin: Cortex-A78AE, dot product and half-precision arithmetic
ORIN = arm_cpuinfo("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop "
                   "asimddp uscat ilrcpc flagm paca pacg", "0xd42")
# Jetson Nano: Cortex-A57, NEON only
NANO = arm_cpuinfo("fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid", "0xd07", tail="\nHardware\t: NVIDIA Jetson Nano\n")


@pytest.mark.parametrize("text, model, isa", [
    (EPYC, "AMD EPYC 7B12", "avx2"),
    (XEON, "Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz", "avx512-vnni"),
    (XEON.replace(" avx512_vnni", ""), "Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz", "avx512"),
    (SANDY, "Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz", "x86-64"),
    (ORIN, "Cortex-A78AE", "neon-dotprod"),
    (NANO, "Cortex-A57 (NVIDIA Jetson Nano)", "neon"),
])
def test_model_and_isa_level(text, model, isa):
    assert (model_name(text), isa_level(text)) == (model, isa)
    assert cpu_field(2, text) == {"model": model, "isa": isa, "threads": 2}
    assert describe(2, text) == f"{model} ({isa}), 2 threads" and describe(1, text).endswith(", 1 thread")


def flags_of(text: str) -> dict[str, str]:
    """-DNAME=VALUE options as {NAME: VALUE}."""
    args = llama_cpp_cmake_args(text).split()
    assert all(a.startswith("-D") and "=" in a for a in args) and args[0] == "-DGGML_NATIVE=OFF"
    return dict(a[2:].split("=", 1) for a in args)


def test_epyc_avx2_gets_no_avx512():
    args = llama_cpp_cmake_args(EPYC)
    assert "AVX512" not in args and "AVX_VNNI" not in args and "NATIVE=ON" not in args
    f = flags_of(EPYC)
    assert {k: f[k] for k in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")} == dict.fromkeys(
        ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"), "ON")


def test_xeon_vnni_gets_avx512_and_vnni_but_only_what_it_lists():
    f = flags_of(XEON)
    assert f["GGML_AVX2"] == f["GGML_AVX512"] == f["GGML_AVX512_VNNI"] == "ON"
    assert "GGML_AVX512_BF16" not in f and "GGML_AVX_VNNI" not in f  # Cascade Lake has neither
    amx = XEON.replace(" avx512_vnni", " avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8")
    g = flags_of(amx)  # a Sapphire Rapids: BF16 and AVX-VNNI too, AMX never (VMs hide it)
    assert g["GGML_AVX512_BF16"] == g["GGML_AVX_VNNI"] == "ON" and "AMX" not in llama_cpp_cmake_args(amx)
    partial = XEON.replace(" avx512bw", "")  # GGML_AVX512 compiles for F, CD, VL, DQ and BW together
    assert "AVX512" not in llama_cpp_cmake_args(partial) and isa_level(partial) == "avx512-vnni"


def test_pre_avx2_x86_turns_off_what_ggml_would_turn_on():
    """GGML_NATIVE=OFF alone turns AVX2, FMA, F16C and BMI2 on: a CPU without them gets them OFF."""
    f = flags_of(SANDY)
    assert [f[k] for k in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")] == ["OFF"] * 4
    assert f["GGML_AVX"] == f["GGML_SSE42"] == "ON" and "GGML_AVX512" not in f


def test_aarch64_dotprod_and_baseline():
    assert llama_cpp_cmake_args(ORIN) == "-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16"
    assert llama_cpp_cmake_args(NANO) == "-DGGML_NATIVE=OFF"  # armv8-a: NEON, which every aarch64 CPU has
    i8mm = ORIN.replace("asimddp", "asimddp i8mm")
    assert llama_cpp_cmake_args(i8mm).endswith("+dotprod+fp16+i8mm")


def test_host_defaults_and_the_flags_bench_and_help_name():
    from edgekv.cli.parsers import LLAMA_CPP_BUILT
    from edgekv.tools import bench

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    assert llama_cpp_cmake_args() == llama_cpp_cmake_args(text) == bench.LLAMA_CPP_FLAGS
    assert cpu_field(3) == cpu_field(3, text) and cpu_field(3)["isa"] in cpu.ISA_LEVELS
    assert f'CMAKE_ARGS="{bench.LLAMA_CPP_FLAGS}"' in LLAMA_CPP_BUILT
    assert f'CMAKE_ARGS="{bench.LLAMA_CPP_FLAGS}"' in bench.LLAMA_CPP_INSTALL
    assert f'CMAKE_ARGS="{bench.LLAMA_CPP_FLAGS}"' in bench.LLAMA_CPP_REBUILD


def test_python_m_cpu_prints_the_flags():
    r = subprocess.run([sys.executable, "-m", "edgekv.runtime.cpu", "--cmake-args"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == llama_cpp_cmake_args()
    r = subprocess.run([sys.executable, "-m", "edgekv.runtime.cpu"], capture_output=True, text=True, cwd=ROOT)
    assert r.stdout.splitlines()[0] == f"cpu: {describe(None)}" and llama_cpp_cmake_args() in r.stdout


def test_sigill_line_names_this_cpu_and_its_flags():
    from edgekv.tools.bench import peer_failure

    line = peer_failure(subprocess.CompletedProcess([], -4, "", ""))
    assert "\n" not in line and describe(None) in line and f'CMAKE_ARGS="{llama_cpp_cmake_args()}"' in line


def test_bench_json_and_output_name_the_cpu(tiny_bundle_int8, tmp_path):
    out = tmp_path / "bench.json"
    r = run_edgekv("bench", tiny_bundle_int8, "--prompt-lengths", "8", "--capacities", "32", "--fill", "8",
                   "--decode-tokens", "2", "--rss-tokens", "20", "--repeat", "1", "--threads", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["cpu"] == cpu_field(1)
    assert f"cpu: {describe(1)}" in r.stdout.splitlines()


def test_llama_cpp_bench_json_names_the_cpu(tmp_path):
    from tests.test_bench_llama_cpp import FAKE, fake_llama_package

    fake = FAKE.replace('        self._log({"init"', '        global _current\n        _current = self\n'
                        '        self._log({"init"')
    folder, gguf = fake_llama_package(tmp_path, "fake", fake)
    env = dict(os.environ, PYTHONPATH=f"{folder}{os.pathsep}{ROOT}", FAKE_LLAMA_LOG=str(tmp_path / "log"))
    r = subprocess.run([sys.executable, "-m", "edgekv.tools.llama_cpp_bench", str(gguf), "--threads", "2",
                        "--n-ctx", "32", "--prompt-lengths", "8", "--vocab", "384", "--decode-tokens", "2",
                        "--repeat", "1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["cpu"] == cpu_field(2)


def test_eval_json_and_output_name_the_cpu(tiny_bundle_int8):
    from edgekv.runtime.backends.base import default_threads
    from edgekv.tools.evaluate import evaluate

    out = io.StringIO()
    res = evaluate([str(tiny_bundle_int8)], "The capital of France is Paris. " * 40, ctx=32, chunks=1, out=out)
    assert res["cpu"] == cpu_field(default_threads())
    assert f"  cpu: {describe(default_threads())}" in out.getvalue().splitlines()
    res = evaluate([str(tiny_bundle_int8)], "The capital of France is Paris. " * 40, ctx=32, chunks=1, threads=1,
                   out=io.StringIO())
    assert res["cpu"]["threads"] == 1


def test_bench_serve_json_names_the_cpu(tiny_bundle_int8, tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    out = tmp_path / "serve.json"
    r = run_edgekv("bench-serve", tiny_bundle_int8, "--clients", "1", "--tokens", "2", "--system-tokens", "8",
                   "--soak", "0", "--threads", "1", "--json", out, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["cpu"] == json.loads(r.stdout)["cpu"] == cpu_field(1)
    assert f"cpu: {describe(1)}" in r.stderr.splitlines()
