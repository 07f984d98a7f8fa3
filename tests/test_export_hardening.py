"""Issue 22, the exporter: re-exporting keeps what the old bundle did not hold, `--weights auto`
keeps what the source holds (and names the bundle by it), the destination is settled before the
model is loaded, the long stages say so on stderr, and the weight check says what it measures
against."""
import json
import os

import pytest

from edgekv.format import files
from edgekv.format.bundle import VERIFIED, load_bundle
from tests.conftest import cli
from tests.test_cli_errors import assert_clean_error


def export_cli(src, out, *extra):
    return cli("export", src, "--out", out, "--max-context", "64", "--steps", "2", *extra)


@pytest.fixture(scope="module")
def reexported(tiny_llama, tiny_bundle_int8, tmp_path_factory):
    """A tiny bundle (a copy of conftest's int8 one), given a user's notes, a build-engine folder
    and a verify record, then exported again into the same folder through the CLI."""
    import shutil

    root = tmp_path_factory.mktemp("reexport")
    out = root / "B"
    shutil.copytree(tiny_bundle_int8, out)
    old_sha = json.loads((out / "edgekv.json").read_text())["files"]["sha256"]
    (out / "NOTES.md").write_text("my notes")
    (out / "engines" / "gpu-trt10.3-ctx256-p256").mkdir(parents=True)
    (out / "engines" / "gpu-trt10.3-ctx256-p256" / "engine.plan").write_bytes(b"plan")
    (out / VERIFIED).write_text("{}")
    second = export_cli(tiny_llama, out, "--kv", "float")
    return root, out, second, old_sha


def test_reexport_keeps_every_file_the_old_bundle_did_not_name(reexported):
    root, out, r, old_sha = reexported
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "NOTES.md").read_text() == "my notes"
    assert (out / "engines" / "gpu-trt10.3-ctx256-p256" / "engine.plan").read_bytes() == b"plan"
    b = load_bundle(out)
    assert b.scheme.name == "float"  # the new bundle's files replaced the old ones
    assert set(b.manifest["files"]["sha256"]) == set(old_sha) and b.manifest["files"]["sha256"] != old_sha
    assert not (out / VERIFIED).exists()  # edgekv's record of the old files went with them
    assert sorted(p.name for p in root.iterdir()) == ["B"]  # nothing renamed aside, no temporary left
    kept = [line for line in r.stderr.splitlines() if "kept in" in line]
    assert len(kept) == 1 and "NOTES.md" in kept[0] and "engines/" in kept[0] and "stale" in kept[0]


def test_export_prints_its_stages_in_order_with_their_times(reexported):
    """The long silent steps (the model's load, torch.export, the parity check) each get a start
    line and a line with their time when they end."""
    r = reexported[2]
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    expected = ["loading ", "  loading: done in ", "exporting ONNX (", "  exporting ONNX: done in ",
                "checking the graph", "  checking the graph: done in ", "verifying ONNX Runtime against PyTorch: ",
                "  verifying ONNX Runtime against PyTorch: done in ", "✓ bundle written: "]
    at = [next((i for i, line in enumerate(lines) if line.startswith(e)), None) for e in expected]
    assert None not in at, [e for e, i in zip(expected, at) if i is None]
    assert at == sorted(at), r.stderr
    assert all(lines[i].rstrip().endswith(" s") for e, i in zip(expected, at) if "done in" in e)


def test_stage_heartbeat_says_the_stage_and_its_time():
    """While a stage runs, a line every `every` seconds; the body waits for the first one (no
    timing decides the test: it fails only if no heartbeat comes within a minute)."""
    import threading

    from edgekv.tools.progress import stage

    said, beat = [], threading.Event()

    def say(line):
        said.append(line)
        if line.startswith("  ... "):
            beat.set()

    with stage("exporting ONNX", " (kv=int8)", every=0.01, say=say):
        assert beat.wait(60)
    assert said[0] == "exporting ONNX (kv=int8) ..."
    assert said[1].startswith("  ... exporting ONNX: ") and said[1].endswith(" s")
    assert said[-1].startswith("  exporting ONNX: done in ")
    with pytest.raises(ValueError), stage("failing", every=60, say=said.append):
        raise ValueError
    assert said[-1] == "failing ..."  # no "done" line for a stage that raised


def test_replace_keeping_leaves_a_clashing_name_and_a_symlink_aside(tmp_path):
    """Only regular files the old manifest names are deleted; a user's entry whose name the new
    bundle also has, and a symlink in a bundle file's place, are kept beside, not deleted."""
    target, new = tmp_path / "B", tmp_path / "new"
    target.mkdir()
    new.mkdir()
    (target / "model.onnx").write_text("old graph")
    (target / "notes.txt").write_text("mine")
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep")
    (target / "tokenizer.json").symlink_to(elsewhere)
    (target / "clash.txt").write_text("old clash")
    for name in ("model.onnx", "tokenizer.json", "clash.txt"):
        (new / name).write_text("new " + name)
    moved, aside = files.replace_dir_keeping(new, target, {"model.onnx", "tokenizer.json"})
    assert moved == ["notes.txt"] and (target / "notes.txt").read_text() == "mine"
    assert (target / "model.onnx").read_text() == "new model.onnx"
    assert aside is not None and aside.name.startswith("B.old-")
    assert sorted(p.name for p in aside.iterdir()) == ["clash.txt", "tokenizer.json"]
    assert (aside / "clash.txt").read_text() == "old clash" and elsewhere.read_text() == "keep"


def test_a_manifest_cannot_name_files_outside_its_folder(tmp_path):
    from export.destination import bundle_files

    b = tmp_path / "B"
    b.mkdir()
    (b / "edgekv.json").write_text(json.dumps({"format_version": 2, "files": {
        "onnx": "../victim", "tokenizer": "/etc/passwd", "sizes": {"model.onnx": 1, "sub/x": 1, "..": 1}}}))
    assert bundle_files(b) == {"edgekv.json", VERIFIED, "model.onnx"}
    (b / "edgekv.json").write_text(json.dumps({"format_version": 2}))  # no file list: only the manifest is ours
    assert bundle_files(b) == {"edgekv.json", VERIFIED}
    (b / "edgekv.json").write_text("{}")  # not a bundle
    assert bundle_files(b) is None


# -- the destination first -------------------------------------------------------------------

def test_out_refused_before_the_model_is_read(tmp_path):
    """A .gguf that is not one: had the exporter read it, the error would be about the file."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all" * 100)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("keep")
    r = cli("export", bad, "--out", out)
    assert_clean_error(r, "not an edgekv bundle")
    assert "broken.gguf" not in r.stderr and (out / "thesis.tex").read_text() == "keep"
    r = cli("export", bad, "--out", out / "thesis.tex" / "B")  # a folder inside a file: never makeable
    assert_clean_error(r, "cannot make a folder there")
    assert "broken.gguf" not in r.stderr and (out / "thesis.tex").read_text() == "keep"


def test_default_out_refused_without_loading_the_model(tiny_llama, tmp_path, monkeypatch):
    """No --out: the default name needs the weights format (auto: from the source's header), and
    the refusal still comes before the model's load."""
    import export.pipeline as eb
    from export import recipes
    from edgekv.errors import ExportError

    def no_load(path):
        raise AssertionError(f"the model was loaded: {path}")

    monkeypatch.setattr(eb, "load_source", no_load)
    monkeypatch.setattr(recipes, "MODELS_DIR", tmp_path)
    taken = tmp_path / "bundles" / f"{tiny_llama.name}-int8"  # an HF folder: float weights, no -w suffix
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_text("keep")
    with pytest.raises(ExportError, match="not an edgekv bundle"):
        eb.export_bundle(str(tiny_llama), kv="int8", weights="auto")
    with pytest.raises(ExportError, match="is a file"):
        eb.export_bundle(str(tiny_llama), kv="int8", out=str(taken / "notes.txt"))


# -- --weights auto --------------------------------------------------------------------------

def _q4(name):
    import gguf

    T = gguf.GGMLQuantizationType
    return T.Q8_0 if name.startswith(("token_embd", "output.")) else (T.Q4_0 if "attn" in name else T.Q4_1)


def _q8(name):
    import gguf

    return gguf.GGMLQuantizationType.Q8_0


def _mixed_qkv(name):  # v in 8 bits, q and k in 4: the fused q|k|v cannot keep its blocks
    import gguf

    T = gguf.GGMLQuantizationType
    return T.Q8_0 if "attn_v" in name or name.startswith("token_embd") else T.Q4_0


@pytest.fixture(scope="module")
def ggufs(tiny_llama, tmp_path_factory):
    from tests.test_gguf import write_gguf

    root = tmp_path_factory.mktemp("auto")
    folder = tiny_llama  # read only: each GGUF is written beside it, in root
    out = {}
    for name, quant in (("q4", _q4), ("q8", _q8), ("f32", None), ("mixed", _mixed_qkv)):
        out[name] = root / f"tiny-{name}.gguf"
        write_gguf(folder, out[name], quant=quant)
    return folder, out


def test_auto_keeps_what_the_source_holds(ggufs):
    """4-bit blocks -> int4, Q8_0 -> int8, float -> float, an HF folder -> float; a fused matrix
    whose parts differ (Q4_0 q|k with a Q8_0 v) meets in one carrier that keeps each part exactly,
    so auto keeps the file's 4-bit blocks then too."""
    from export.recipes import source_weights

    folder, g = ggufs
    assert source_weights(g["q4"], "auto")[0] == "int4"
    assert source_weights(g["q8"], "auto")[0] == "int8"
    assert source_weights(g["f32"], "auto")[0] == "float"
    assert source_weights(g["mixed"], "auto")[0] == "int4"
    assert source_weights(folder, "auto")[0] == "float"
    assert source_weights(g["q4"], "float")[0] == "float"  # a format asked for is taken as asked


def test_auto_agrees_with_the_blocks_the_loader_keeps(ggufs):
    """The header-only decision = the same rule on what the full load keeps (src.blocks, fused
    matrices included): auto never picks a format under which the loader would requantize."""
    from export.recipes import source_weights
    from export.gguf_loader import load_gguf
    from export.weights import auto_format

    _, g = ggufs
    for name, path in g.items():
        src = load_gguf(path)
        kept = {n: {src.blocks[n].origin.split()[-1]} if n in src.blocks else {"F32"}
                for n, w in src.state_dict.items() if w.dim() == 2}
        assert auto_format(kept, "embed.weight", "lm_head.weight") == source_weights(path, "auto")[0], name


def test_cli_export_defaults_to_auto():
    from edgekv.cli import build_parser

    assert build_parser().parse_args(["export"]).weights == "auto"


def test_auto_export_of_a_4bit_gguf_is_int4_named_so_and_says_what_its_kld_is_against(ggufs, tmp_path, monkeypatch,
                                                                                        capfd):
    import export.pipeline as eb
    from export import recipes

    _, g = ggufs
    monkeypatch.setattr(recipes, "MODELS_DIR", tmp_path)
    out = eb.export_bundle(str(g["q4"]), kv="int8", weights="auto", max_context=64, steps=2)
    assert out == tmp_path / "bundles" / "tiny-q4-int8-wint4"
    b = load_bundle(out)
    assert b.weights == "int4" and b.manifest["weights"]["source_blocks_kept"]
    assert {"gguf Q4_0", "gguf Q4_1", "gguf Q8_0"} <= set(b.manifest["weights"]["stored"])
    cost = b.manifest["parity"]["weight_quantization"]["vs_source_weights"]
    assert "dequantized" in cost["reference"] and "kept exactly" in cost["reference"]
    line = next(x for x in capfd.readouterr().err.splitlines() if "weights as stored vs" in x)
    assert "GGUF's blocks dequantized" in line and "not that its 4 bits are lossless" in line
