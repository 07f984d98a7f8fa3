"""The graph passes, one file each, and how a backend runs them.

A pass has a `name` (what the load line says) and `apply(index) -> report`: it rewrites the
index's graph in place and returns its report, whose `changed` says whether it did. Passes run in
the order given; the index is rebuilt after each one that changed the graph.

| pass | file | who runs it |
|---|---|---|
| fused-attention | fused_attention.py (matcher: fused_match.py) | ort-cpu, ort-cuda: GroupQueryAttention per layer |
| cache-reads | cache_reads.py | ort: the int8 cache's unit DequantizeLinear as the Cast it is |
| exact-sums | exact_sums.py | ort-cpu: row-independent attention (ExactAttention) |
| minimum-fold | minimum_fold.py | ort-cpu: a GGUF minimum as MatMulNBits zero points |
| weight-forms | weight_forms.py | ort: packed codes and factored scales unpacked, handed to the session |
| trt-staging | trt_staging.py | the TensorRT engine build and check-trt: fp16 scales and forms folded |

The runtime adds its onnxruntime-specific passes (they probe the installed kernels):
backends/nbits8.py (8-bit MatMulNBits below 1.25), backends/rows.py (row padding), and the fused
graph's query-lengths (backends/fused.py) and without-bias (backends/ort_cuda.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Pass(Protocol):
    name: str

    def apply(self, index) -> object:
        """Rewrite index's graph in place; the report (its `changed`: whether the graph changed)."""


@dataclass
class Changed:
    """The report of a pass with nothing more to say than whether it changed the graph."""
    changed: bool
    count: int = 0  # what it rewrote (nodes, matrices), where it counts


@dataclass
class Ran:
    name: str
    report: object

    @property
    def changed(self) -> bool:
        return bool(getattr(self.report, "changed", False))


def run_passes(index, passes: list) -> list[Ran]:
    """Apply `passes` to `index` in order; what each reported."""
    ran = []
    for p in passes:
        report = p.apply(index)
        ran.append(Ran(p.name, report))
        if ran[-1].changed:
            index.reindex()
    return ran


def line(ran: list[Ran], prefix: str = "graph passes") -> str:
    """The load line: the passes that changed the graph, in order (none: 'the graph as written')."""
    names = [r.name for r in ran if r.changed]
    return f"{prefix}: {', '.join(names) if names else 'none (the graph as written)'}"
