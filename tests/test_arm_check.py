"""jetson/arm_check.sh (the runtime's tests on aarch64 under qemu-user, issue 40 item 3b) stays
runnable: it parses, its plan prints without root or side effects, every test it names is still
collected here, and tests/arm_bundles.py's made_once redirection does what the check relies on.
The emulated run itself takes minutes and root: run the script."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "jetson" / "arm_check.sh"


def script(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_the_script_parses_and_is_strict():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and os.access(SCRIPT, os.X_OK)
    assert "set -euo pipefail" in text
    assert not re.search(r"\b(pkill|killall)\b", text)
    assert len(re.findall(r"^phase \w+", text, re.M)) == 6  # binfmt root venv export copy arm, each timed


@pytest.mark.skipif(not shutil.which("shellcheck"), reason="shellcheck is not installed")
def test_shellcheck_finds_no_errors():
    r = subprocess.run(["shellcheck", "-S", "warning", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_help_and_a_bad_option():
    r = script("--help")
    assert r.returncode == 0 and "--dry-run" in r.stdout and "--root DIR" in r.stdout
    r = script("--no-such-option")
    assert r.returncode == 2 and "unknown option" in r.stderr


def test_dry_run_prints_the_plan_and_honours_the_overrides(tmp_path):
    root, bundles = tmp_path / "r", tmp_path / "b"
    r = script("--dry-run", "--cpu", "max", env={"EDGEKV_ARM_ROOT": str(root), "EDGEKV_ARM_BUNDLES": str(bundles)})
    assert r.returncode == 0, r.stderr
    for phase in ("binfmt", "root", "venv", "export", "copy", "arm"):
        assert re.search(rf"^  {phase} ", r.stdout, re.M), phase
    assert str(root) in r.stdout and f"EDGEKV_EXPORT_BUNDLES={bundles}" in r.stdout and "QEMU_CPU=max" in r.stdout
    assert "debootstrap --arch=arm64 --variant=minbase" in r.stdout and "onnxruntime" in r.stdout
    assert "torch" not in r.stdout.split("venv", 1)[1].split("\n", 1)[0]  # no torch in the root
    assert not root.exists() and not bundles.exists()  # a dry run makes nothing


def test_every_test_the_check_names_is_collected():
    """The default and --wide selections and the node ids --deselect leaves out are all still
    tests here (collected on this machine, as the host phase collects them)."""
    ids = script("--list-tests", "--wide").stdout.split()
    default = script("--list-tests").stdout.split()
    left_out = script("--list-deselected").stdout.split()
    assert default and set(default) < set(ids) and len(ids) == len(set(ids)) and left_out
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.arm_bundles",
                        "-p", "no:cacheprovider", "-o", "addopts=", *ids],
                       capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={k: v for k, v in os.environ.items() if not k.startswith("EDGEKV_")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    collected = [line for line in r.stdout.splitlines() if "::" in line]
    for node in ids + left_out:
        assert any(c == node or c.startswith((node + "::", node + "[")) for c in collected), node


def test_host_only_modules_are_stand_ins_where_they_cannot_be_imported(monkeypatch):
    """On the target a fixture's `from export.pipeline import export_bundle` (before made_once, which
    never calls it there) imports a stand-in that raises only when called."""
    from tests import arm_bundles

    name = "edgekv_arm_check_no_such_package"
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    try:
        assert arm_bundles.stand_in_host_only_modules((name, "json")) == [name]  # json imports: kept
        from edgekv_arm_check_no_such_package.bundle import export_bundle  # noqa: PLC0415
        with pytest.raises(RuntimeError, match="runs on the host"):
            export_bundle("x")
    finally:
        for m in [m for m in sys.modules if m.split(".")[0] == name]:
            del sys.modules[m]


def test_made_once_is_redirected_by_mode(tmp_path, monkeypatch):
    from tests import arm_bundles

    made = []

    def original(path, make):
        made.append(path)
        make(path)
        return path

    monkeypatch.delenv(arm_bundles.PREBUILT_ENV, raising=False)
    monkeypatch.delenv(arm_bundles.EXPORT_ENV, raising=False)
    assert arm_bundles.mode() is None
    export = arm_bundles._redirect(original, "export", tmp_path / "x")
    assert export(tmp_path / "run" / "tiny-int8", lambda p: p.mkdir()) == tmp_path / "x" / "tiny-int8"
    assert made == [tmp_path / "x" / "tiny-int8"]

    prebuilt = arm_bundles._redirect(original, "prebuilt", tmp_path / "x")
    with pytest.raises(pytest.fail.Exception, match="tiny-int8 is not among"):  # no .done marker
        prebuilt(tmp_path / "run" / "tiny-int8", lambda p: pytest.fail("made"))
    (tmp_path / "x" / "tiny-int8.done").touch()
    assert prebuilt(tmp_path / "run" / "tiny-int8", lambda p: pytest.fail("made")) == tmp_path / "x" / "tiny-int8"
    assert len(made) == 1

    monkeypatch.setenv(arm_bundles.PREBUILT_ENV, str(tmp_path))
    monkeypatch.setenv(arm_bundles.EXPORT_ENV, str(tmp_path))
    with pytest.raises(pytest.UsageError):
        arm_bundles.mode()
