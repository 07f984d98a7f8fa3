"""The bundle's weight forms (edgekv/format/weight_forms.py: 5/6-bit codes packed as the GGUF
stores them, a K-quant's factored scales) unpacked by us at load and handed to onnxruntime as
OrtValues over our arrays, instead of left to its constant folding. Measured on the default
model's Q4_K_M bundle (peak RSS of `edgekv generate`): onnxruntime folding them itself 1169 MiB,
handed 550, the same weights stored at 8 bits 413 (the handed arrays stay ours for the session's
life: onnxruntime takes only user-owned buffers; docs/weights.md, "Codes at the file's width").
An fp16 scale's single Cast stays for onnxruntime: that one costs nothing ("fp16 scales")."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgekv.format.weight_forms import form_values, replace_forms

# handed to onnxruntime with the session options (add_external_initializers): in the serialized
# graph these are placeholders at this "location", never read from a file
HANDED = "edgekv:handed-at-load"


def handed_tensor(name: str, a: np.ndarray):
    """An initializer of `a`'s type and shape whose data comes with the session options (Handed)."""
    from onnx import TensorProto, helper

    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(a.dtype), dims=list(a.shape),
                    data_location=TensorProto.EXTERNAL)
    for k, v in (("location", HANDED), ("offset", "0"), ("length", str(a.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


@dataclass
class Handed:
    """Arrays (name, array) a session takes by reference; kept alive as long as it is."""
    buffers: list = field(default_factory=list, repr=False)

    def hand_to(self, ort, opts) -> list:
        """Give the session options the arrays; returns the OrtValues, to be kept as long as the session."""
        values = [ort.OrtValue.ortvalue_from_numpy(a) for _, a in self.buffers]
        if values:
            opts.add_external_initializers([n for n, _ in self.buffers], values)
        return values


def unpack_forms(graph: bytes, base_dir: str) -> tuple[bytes, Handed]:
    """The serialized graph with every weight form of more than one node replaced by a placeholder
    initializer whose value the returned Handed gives the session (the graph as given, and nothing
    to hand, when it has none)."""
    import onnx

    model = onnx.load_from_string(graph)
    values, gone = form_values(model.graph, base_dir, least=2)
    if not values:
        return graph, Handed()
    replace_forms(model.graph, gone, [handed_tensor(n, a) for n, a in values.items()])
    return model.SerializeToString(), Handed(list(values.items()))
