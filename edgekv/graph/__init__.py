"""ONNX graph passes over one graph index (docs/graph.md, "Graph passes").

index.py is the index (GraphIndex: producers, consumers, initializers, value_info, the edits a
rewrite makes); forms.py reads the bundle's weight forms; passes/ holds one file per pass. A
backend is a list of passes plus a session: it runs its passes over the bundle's graph
(`passes.run_passes`) and its load line names the ones that changed it (`passes.line`).

This package sits below format/ (onnx and numpy only; onnxruntime only where a pass evaluates a
constant subgraph): the format layer's TensorRT staging, the runtime's backends and the exporter
all use it, and it imports none of them."""
