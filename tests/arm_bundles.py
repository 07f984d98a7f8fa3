"""Tiny bundles exported on one machine (x86, torch) and tested on another (aarch64 under qemu-user,
no torch): issue 40 item 3b, jetson/arm_check.sh.

A pytest plugin (`-p tests.arm_bundles`) that moves what conftest's made_once makes (the tiny
checkpoints and bundles every tiny_* fixture shares: tiny-llama, tiny-int8, tiny-int8-static,
tiny-int8-wint4, ...) into one folder, in two modes chosen by the environment:

* EDGEKV_EXPORT_BUNDLES=DIR (the host, with torch): made_once(path, make) makes DIR/<path's name>
  instead (or reuses it: its `.done` marker). `pytest -p tests.arm_bundles TESTS` thus exports
  exactly the bundles the chosen tests ask for, by conftest's own code, and is their x86 run
  (run, not --setup-only: some tests ask a fixture's factory for a bundle in their body).
* EDGEKV_PREBUILT_BUNDLES=DIR (the target, no torch): made_once hands out DIR/<name> and never
  makes anything; a name that is not there fails the test that needs it (export on the host with
  the same selection).

Without either variable the plugin does nothing.

On the target a fixture may import the exporter before it calls made_once (conftest's
tiny_gguf_bundles: `from export.pipeline import export_bundle`, `from tests.test_gguf import
write_gguf`, whose import needs torch): in prebuilt mode, once the tests are collected, such
host-only modules that cannot be imported here (HOST_ONLY) are stand-ins whose every attribute is a
function that raises (the stand-in is never called: made_once does not call make).

The file's tests (collected when it is named: `pytest tests/arm_bundles.py`; they skip without
one of the variables) cover what tests/test_weights.py checks of onnxruntime's low-bit kernels,
which cannot run without torch (it imports it): the tiny Llama exported with 4- and 8-bit weights
(`--weights int4` / `int8`, conftest's checkpoint) runs every projection and the head as one
MatMulNBits, gives the logits the x86 build gave (written beside the bundle at export), and a
batched decode equals each sequence decoded alone bit for bit.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

EXPORT_ENV = "EDGEKV_EXPORT_BUNDLES"
PREBUILT_ENV = "EDGEKV_PREBUILT_BUNDLES"
WEIGHTS = {"int4": "tiny-w4", "int8": "tiny-w8"}  # --weights -> made_once name
REF_IDS = [5, 17, 99, 3, 250, 42, 7, 300, 11, 64]  # the first prefilled, the rest decoded
ACCURACIES = (0, 4)  # MatMulNBits with float activations, and the runtime's default (int8 activations)


def _dir(var: str) -> Path | None:
    d = os.environ.get(var)
    return Path(d).resolve() if d else None


def mode() -> tuple[str, Path] | None:
    export, prebuilt = _dir(EXPORT_ENV), _dir(PREBUILT_ENV)
    if export and prebuilt:
        raise pytest.UsageError(f"set {EXPORT_ENV} (host) or {PREBUILT_ENV} (target), not both")
    return ("export", export) if export else ("prebuilt", prebuilt) if prebuilt else None


# --- the plugin: conftest's made_once redirected --------------------------------------------

def _conftests(config) -> list:
    """The conftest modules loaded that define made_once (tests/conftest.py)."""
    return [p for p in config.pluginmanager.get_plugins()
            if Path(getattr(p, "__file__", None) or "x").name == "conftest.py"
            and callable(getattr(p, "made_once", None))]


def _redirect(original, how: str, folder: Path):
    def made_once(path: Path, make) -> Path:
        target = folder / Path(path).name
        if how == "export":
            folder.mkdir(parents=True, exist_ok=True)
            return original(target, make)
        if target.is_dir() and target.with_name(target.name + ".done").exists():
            return target
        pytest.fail(f"{target.name} is not among the bundles exported into {folder} ({PREBUILT_ENV}): export "
                    f"it on the host ({EXPORT_ENV}=DIR pytest -p tests.arm_bundles <the same tests>)",
                    pytrace=False)
    made_once.redirected = True
    return made_once


def _patch(config) -> None:
    m = mode()
    if m is None:
        return
    for c in _conftests(config):
        if not getattr(c.made_once, "redirected", False):
            c.made_once = _redirect(c.made_once, *m)


HOST_ONLY = ("export", "tests.test_gguf")  # what fixtures import before made_once (host-side makers)


class _HostOnly(types.ModuleType):
    """A host-only module on the target: importable, its attributes functions that raise."""
    __path__: list = []  # a package: its submodules are stand-ins too

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def host_only(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{attr} runs on the host (torch, the exporter); here made_once "
                               f"hands out the bundles exported into {PREBUILT_ENV}")
        return host_only


class _HostOnlyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The submodules of the host-only packages that could not be imported here, as stand-ins."""

    def __init__(self, packages):
        self.packages = tuple(packages)

    def find_spec(self, name, path=None, target=None):
        if name.startswith(tuple(p + "." for p in self.packages)):
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _HostOnly(spec.name)

    def exec_module(self, module):
        pass


def stand_in_host_only_modules(names=HOST_ONLY) -> list[str]:
    """Each of `names` that cannot be imported here becomes a stand-in (its submodules too); returns them."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = _HostOnly(name)
            missing.append(name)
    if missing:  # first: an editable install's finder would find the real submodules by name
        sys.meta_path.insert(0, _HostOnlyFinder(missing))
    return missing


def pytest_configure(config):
    _patch(config)


def pytest_collection_finish(session):  # a conftest first met while collecting
    _patch(session.config)
    m = mode()
    if m and m[0] == "prebuilt" and not any(isinstance(f, _HostOnlyFinder) for f in sys.meta_path):
        stand_in_host_only_modules()


def pytest_report_header(config):
    m = mode()
    if m:
        import platform

        return f"arm_bundles: {m[0]} mode, bundles in {m[1]} ({platform.machine()})"


# --- the low-bit weight bundles -------------------------------------------------------------

def ref_logits(bundle: Path, accuracy: int) -> np.ndarray:
    """Logits of REF_IDS (the first prefilled, each next one decoded) on ort-cpu at `accuracy`."""
    from edgekv.runtime.assemble import open_runtime  # (a Stream: the batcher, one request per call)

    with open_runtime(bundle, 64, "ort-cpu", threads=1, max_logits_rows=len(REF_IDS), log=None,
                      matmul_accuracy=accuracy) as rt:
        gen = rt.stream(prefill_chunk=len(REF_IDS))
        rows = [gen.prefill(REF_IDS[:1]).copy()]
        rows += [gen.decode_step(t).copy() for t in REF_IDS[1:]]
        return np.stack(rows)


def ref_path(bundle: Path) -> Path:
    return bundle.with_name(bundle.name + ".x86-logits.npz")


@pytest.fixture(scope="module", params=sorted(WEIGHTS))
def wbundle(request, tmp_path_factory) -> tuple[str, Path]:
    """(weights, bundle): conftest's tiny Llama exported with an int8 cache and `weights`, as
    tests/test_chat_hardening.py's tiny_bundle_w8 is, once per run (made_once); on export, the
    x86 logits of REF_IDS beside it."""
    m = mode()
    if m is None:
        pytest.skip(f"neither {EXPORT_ENV} nor {PREBUILT_ENV} is set (jetson/arm_check.sh sets them)")
    fmt = request.param
    c = _conftests(request.config)[0]

    def make(path: Path) -> None:
        from export.pipeline import export_bundle

        export_bundle(str(request.getfixturevalue("tiny_llama")), kv="int8", out=str(path), max_context=256,
                      steps=8, weights=fmt)
    bundle = c.made_once(c.run_dir(tmp_path_factory) / WEIGHTS[fmt], make)
    if m[0] == "export":
        import platform

        np.savez(ref_path(bundle), machine=np.array(platform.machine()),
                 **{f"acc{a}": ref_logits(bundle, a) for a in ACCURACIES})
    return fmt, bundle


def test_low_bit_weights_run_as_matmulnbits(wbundle, monkeypatch, tmp_path):
    """onnxruntime's optimized graph here: every projection and the head one MatMulNBits (the
    fused low-bit kernel), no float copy of a weight matrix (tests/test_weights.py's check)."""
    import collections

    from onnx import TensorProto

    from tests.conftest import optimized_graph

    fmt, bundle = wbundle
    g = optimized_graph(bundle, monkeypatch, tmp_path)
    ops = collections.Counter(n.op_type for n in g.node)
    assert ops["MatMulNBits"] == 2 * 4 + 1, (fmt, dict(ops))
    assert not any(i.data_type == TensorProto.FLOAT and len(i.dims) == 2 and min(i.dims) >= 64
                   for i in g.initializer), "a float weight matrix is left in the graph"


@pytest.mark.parametrize("accuracy", ACCURACIES)
def test_low_bit_logits_are_the_x86_builds(wbundle, accuracy):
    """This machine's onnxruntime (its own MatMulNBits kernels) against the x86 build's logits at
    export. Float activations (accuracy 0): the same to float rounding, the same greedy tokens.
    int8 activations (accuracy 4, the runtime's default): each CPU quantizes and sums otherwise
    (measured 0.2 apart of logits up to 4.3 on the 4-bit bundle: aarch64's kernels against
    AVX-512 VNNI's), so they are held where tests/test_weights.py holds x86's: within 5 % of the
    float-activation logits, and to the same greedy tokens."""
    fmt, bundle = wbundle
    with np.load(ref_path(bundle)) as ref:
        exact, same, machine = ref["acc0"], ref[f"acc{accuracy}"], str(ref["machine"])
    got = ref_logits(bundle, accuracy)
    scale, diff, off = np.abs(exact).max(), np.abs(got - same).max(), np.abs(got - exact).max()
    print(f"{fmt} weights, accuracy {accuracy}: max |here - {machine}| = {diff:.3g}, "
          f"|here - {machine} float activations| = {off:.3g} (logits up to {scale:.3g})")
    if accuracy == 0:
        assert diff <= 1e-3 * scale, f"logits differ by {diff:.3g} of {scale:.3g}"
    else:
        assert off <= 0.05 * scale, f"int8 activations move the logits by {off:.3g} of {scale:.3g}"
    assert (got.argmax(-1) == exact.argmax(-1)).all()


def test_low_bit_batched_equals_alone_bit_for_bit(wbundle):
    """tests/test_int4_determinism.py's oracle on the low-bit tiny bundle: the serving engine's
    schedule (joining, mixed prefill and decode, leaving) gives every sequence the logits of its
    lone decode, exactly: no MatMulNBits row may depend on the call's row count."""
    from edgekv.runtime.assemble import open_runtime
    from tests.test_int4_determinism import assert_same
    from tests.test_serve_engine import alone, batch_schedule

    fmt, bundle = wbundle
    with open_runtime(bundle, ctx=256, backend="ort-cpu", threads=1) as rt:
        assert rt.bundle.weights == fmt
        engine = rt.batcher(capacity=256, parallel=4, prefill_chunk=8)
        spec, reqs, _ = batch_schedule(engine)
        for k, (prompt, n) in spec.items():
            assert_same(reqs[k].out, reqs[k].logits, *alone(rt, prompt, n), f"{fmt} {k}")


if __name__ == "__main__":
    sys.exit(f"a pytest plugin: pytest -p tests.arm_bundles ... (see {__file__}'s docstring)")
