"""The export package imports sympy with no bound on its cache (torch.export's symbolic shapes rebuild
evicted expressions otherwise: a slower ONNX step), leaving the environment as it was and a
SYMPY_CACHE_SIZE the user set in force. In a fresh interpreter: sympy reads it once, on import."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = ("import json, os, export.model, sympy.core.cache as c; "
         "print(json.dumps([c.SYMPY_CACHE_SIZE, os.environ.get('SYMPY_CACHE_SIZE')]))")


def probe(**env):
    e = {k: v for k, v in os.environ.items() if k != "SYMPY_CACHE_SIZE"}
    e.update(env, PYTHONPATH=str(ROOT) + os.pathsep + e.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PROBE], env=e, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_unbounded_without_touching_the_environment():
    assert probe() == [None, None]  # sympy's own default is 1000


def test_a_size_the_user_set_wins():
    assert probe(SYMPY_CACHE_SIZE="500") == [500, "500"]
