"""The exporter's source key: what lets the slow tests reuse a bundle only when the code under
test made it (tests/conftest.py real_bundle)."""
import shutil

from edgekv.format.bundle import load_bundle
from export.manifest import SOURCE_GLOBS, exporter_source_key
from tests.conftest import ROOT, made_by_this_exporter


def test_bundles_record_the_key_of_the_exporter_that_made_them(tiny_bundle_int8):
    key = exporter_source_key()
    assert load_bundle(tiny_bundle_int8).manifest["exporter"]["source_key"] == key
    assert made_by_this_exporter(tiny_bundle_int8, key, "int8")
    assert not made_by_this_exporter(tiny_bundle_int8, "0" * 16, "int8")
    assert not made_by_this_exporter(tiny_bundle_int8, key, "int8-static")  # another scheme
    assert made_by_this_exporter(tiny_bundle_int8, key, "auto")  # auto's fallback
    assert not made_by_this_exporter(ROOT / "no-such-bundle", key, "int8")


def test_the_key_follows_the_exporter_sources(tmp_path):
    for g in SOURCE_GLOBS:
        for f in ROOT.glob(g):
            dst = tmp_path / f.relative_to(ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dst)
    (tmp_path / "edgekv" / "chat" / "session.py").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "edgekv" / "chat" / "session.py").write_text("# the runtime does not change a bundle\n")
    key = exporter_source_key(tmp_path)
    assert key == exporter_source_key(ROOT)
    for rel in ("export/calibrate.py", "edgekv/format/kvschemes.py", "edgekv/format/trt_rules.py", "models/smollm2-135m-instruct.json"):
        f = tmp_path / rel
        orig = f.read_bytes()
        f.write_bytes(orig + b"\n")
        assert exporter_source_key(tmp_path) != key, rel
        f.write_bytes(orig)
    assert exporter_source_key(tmp_path) == key


def test_the_key_covers_every_exporter_module():
    """A module split out of (or moved within) the exporter stays in the key."""
    covered = {f for g in SOURCE_GLOBS for f in ROOT.glob(g)}
    missing = [str(f.relative_to(ROOT)) for top in ("export", "edgekv/format")
               for f in (ROOT / top).rglob("*.py") if f not in covered and "__pycache__" not in f.parts]
    assert missing == []
