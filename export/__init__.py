"""The exporter (workstation, torch). Importing it first sets sympy's cache (below)."""
import os
import sys


def import_sympy_with_unbounded_cache() -> None:
    """torch.export's symbolic shapes (every export traces the model twice, and each op's sizes
    and strides are sympy expressions) reuse the same expressions op after op; at sympy's default
    cache of 1000 entries they are evicted and rebuilt, and the ONNX step takes ~1.25x as long.
    sympy reads SYMPY_CACHE_SIZE once, when it is first imported (torch imports it
    lazily, on the first export), so it is imported here, before any trace, with no bound. The
    environment is left as it was; a SYMPY_CACHE_SIZE the user set, or a sympy already imported, wins."""
    if "sympy" in sys.modules or "SYMPY_CACHE_SIZE" in os.environ:
        return
    os.environ["SYMPY_CACHE_SIZE"] = "None"
    try:
        import sympy  # noqa: F401
    finally:
        del os.environ["SYMPY_CACHE_SIZE"]


import_sympy_with_unbounded_cache()
