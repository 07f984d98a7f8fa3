"""Which onnxruntime the runtime needs, and what each later release adds (issue 40 item 3a: the
Jetson's stock Pythons; tests/test_ort_versions.py). Measured with each release's x86 wheel on the
tiny bundles' tests:

- 1.20: cannot run a bundle. The runtime hands onnxruntime its rewritten graph as bytes and points
  `session.model_external_initializers_file_folder_path` at the bundle's folder for the weights;
  1.20 ignores that entry and looks for model.onnx.data in the working directory.
- 1.21: runs every bundle; 8-bit block weights stay DequantizeLinear -> MatMul in float32 (its
  MatMulNBits has no 8-bit kernel; nbits8.py's load line says so).
- 1.22 (ORT_FLOOR, pyproject's): MatMulNBits runs 8 bits at the runtime's accuracy level 4, so
  nbits8.py writes them as onnxruntime 1.25 would; 1.23 also at level 0 (the exporter's parity check).
- 1.23.2: the newest wheel for CPython 3.10 on aarch64 (JetPack 6's Python).
- 1.25: onnxruntime fuses 8-bit block weights itself (nbits8.NBITS8_FUSION_ORT).
- 1.27: GroupQueryAttention over an int8 cache on CPU: the fused path (fused.MIN_ORT).
- 1.32: its query_seqlens: serve's fused slots (ort.QUERY_LENGTHS_ORT)."""
from __future__ import annotations

ORT_LOADS = (1, 21)  # the first release that runs a bundle at all
ORT_FLOOR = (1, 22)  # pyproject's floor: every weight form on a MatMulNBits kernel


def ort_version(version: str) -> tuple[int, int]:
    """(major, minor) of an onnxruntime version string ("1.23.2", "1.33.0.dev20261201")."""
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:2]]
    return tuple(parts + [0] * (2 - len(parts)))


def dotted(v: tuple[int, int]) -> str:
    return ".".join(map(str, v))


def too_old(version: str) -> str | None:
    """Why onnxruntime `version` cannot run a bundle (None: it can). pip keeps the `onnxruntime`
    package at pyproject's floor; this catches what it does not see (an onnxruntime-gpu wheel from
    NVIDIA's index, a pinned older install)."""
    if ort_version(version) >= ORT_LOADS:
        return None
    return (f"onnxruntime {version} cannot run a bundle (it ignores the weights' folder the runtime gives it): "
            f"edgekv needs onnxruntime >= {dotted(ORT_FLOOR)} (pip install 'onnxruntime>={dotted(ORT_FLOOR)}', "
            f"or a newer onnxruntime-gpu)")
