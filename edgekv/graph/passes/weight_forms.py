"""weight-forms: the bundle's weight forms (edgekv/graph/forms.py: 5/6-bit codes packed as the GGUF
stores them, a K-quant's factored scales) unpacked by us at load and handed to onnxruntime as
OrtValues over our arrays, instead of left to its constant folding. Measured on the default
model's Q4_K_M bundle (peak RSS of `edgekv generate`): onnxruntime folding them itself 1169 MiB,
handed 550, the same weights stored at 8 bits 413 (the handed arrays stay ours for the session's
life: onnxruntime takes only user-owned buffers; docs/weights.md, "Codes at the file's width").
An fp16 scale's single Cast stays for onnxruntime: that one costs nothing ("fp16 scales")."""
from __future__ import annotations

from edgekv.graph.forms import Handed, form_values, handed_tensor, replace_forms
from edgekv.graph.index import GraphIndex
from edgekv.graph.passes import Changed


def unpack(index: GraphIndex) -> int:
    """Every weight form of more than one node replaced (in place) by a placeholder initializer
    whose value goes to index.handed; how many."""
    values, gone = form_values(index.g, index.base_dir, least=2)
    if values:
        replace_forms(index.g, gone, [handed_tensor(n, a) for n, a in values.items()])
        index.handed.update(values)
    return len(values)


class WeightForms:
    name = "weight-forms"

    def apply(self, index: GraphIndex) -> Changed:
        n = unpack(index)
        return Changed(n > 0, n)


def unpack_forms(graph: bytes, base_dir: str) -> tuple[bytes, Handed]:
    """The serialized graph with its forms unpacked (as given, and nothing to hand, where it has none)."""
    index = GraphIndex.from_bytes(graph, base_dir)
    if not unpack(index):
        return graph, Handed()
    return index.serialize(), Handed(list(index.handed.items()))
