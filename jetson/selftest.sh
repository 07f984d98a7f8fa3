#!/usr/bin/env bash
# The Jetson self-test, for the board's owner. Run from a clone of edgekv on the Jetson:
#
#   bash jetson/selftest.sh models/bundles/smollm2-135m-instruct-int8-fp16 [--ctx 1024]
#   bash jetson/selftest.sh BUNDLE-fp16 BUNDLE-fp16-wint4     # + an INT4-weights engine
#
# Needs: JetPack 6 (TensorRT 10.3 + its python3-libnvinfer, CUDA), cuda-python, and edgekv's
# runtime installed without torch:  pip install --no-deps -e . && pip install numpy onnx tokenizers jinja2
# (plus onnxruntime, or NVIDIA's onnxruntime-gpu wheel for JetPack to test ort-cuda too).
# Prints versions, builds the engine, checks trt (and ort-cuda) against ort-cpu, runs the
# benchmark with tegrastats power; writes edgekv-selftest.json. Exit 0 = everything passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import edgekv" 2>/dev/null; then
    echo "selftest: edgekv is not importable by $PY; install it first (see the comment at the top of $0)" >&2
    exit 1
fi
exec "$PY" -m jetson.selftest "$@"
