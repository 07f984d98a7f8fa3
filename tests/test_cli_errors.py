"""Bad input: one line on stderr, non-zero exit, no traceback, nothing half-written. Most checks
call the command in-process (conftest's cli: what main prints and returns); the entry point
itself (`python -m edgekv`: its exit status, argv's bytes, --help, --version, serve) runs as a
process."""
import json
from pathlib import Path

import pytest

from tests.conftest import cli, run_edgekv


def assert_clean_error(r, pattern):
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert lines and "error:" in lines[-1] and pattern in lines[-1], r.stderr
    assert len([l for l in lines if "error" in l]) == 1


def test_missing_bundle(tmp_path):
    assert_clean_error(cli("generate", tmp_path / "nope", "hi"), "no such bundle")


def test_not_a_bundle(tmp_path):
    assert_clean_error(cli("generate", tmp_path, "hi"), "not an edgekv bundle")


def test_corrupt_manifest(bundle_copy):
    (bundle_copy / "edgekv.json").write_text("{not json")
    assert_clean_error(run_edgekv("generate", bundle_copy, "hi"), "corrupt manifest")


def test_truncated_weights(bundle_copy):
    data = bundle_copy / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:1000])
    assert_clean_error(cli("generate", bundle_copy, "hi"), "corrupt bundle")


def test_garbage_graph_same_size(bundle_copy):
    g = bundle_copy / "model.onnx"
    g.write_bytes(b"\xff" * g.stat().st_size)
    assert_clean_error(cli("generate", bundle_copy, "hi"), "corrupt bundle")


def test_unknown_format_version(bundle_copy):
    m = json.loads((bundle_copy / "edgekv.json").read_text())
    m["format_version"] = 99
    (bundle_copy / "edgekv.json").write_text(json.dumps(m))
    assert_clean_error(cli("generate", bundle_copy, "hi"), "format_version 99 is not supported")


def test_version_1_bundle_asks_for_a_re_export(bundle_copy):
    """Version 1 graphs took key_mask [B, P+S]; this runtime binds [B, S, P+S] (docs/graph.md)."""
    m = json.loads((bundle_copy / "edgekv.json").read_text())
    m["format_version"] = 1
    (bundle_copy / "edgekv.json").write_text(json.dumps(m))
    for cmd in (("generate", bundle_copy, "hi"), ("serve", bundle_copy)):
        assert_clean_error(run_edgekv(*cmd), "re-export the model")


def test_prompt_longer_than_capacity(tiny_bundle_int8):
    r = cli("generate", tiny_bundle_int8, "capital of France " * 40, "--ctx", "32")
    assert_clean_error(r, "cache holds 32")


def test_empty_prompt(tiny_bundle_int8):
    assert_clean_error(cli("generate", tiny_bundle_int8, "   "), "empty prompt")


def test_ctx_beyond_bundle(tiny_bundle_int8):
    assert_clean_error(cli("generate", tiny_bundle_int8, "hi", "--ctx", "100000"), "verified for")


def test_unsupported_architecture_export(tiny_llama, tmp_path):
    import shutil

    folder = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    r = cli("export", folder, "--out", out)
    assert_clean_error(r, "unsupported architecture")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_wrong_model_folder(tmp_path):
    assert_clean_error(cli("export", tmp_path, "--out", tmp_path / "o"), "no config.json")
    assert_clean_error(cli("export", tmp_path / "x.bin", "--out", tmp_path / "o"), "no such recipe")


def test_export_refuses_unknown_scheme(tiny_llama, tmp_path):
    assert_clean_error(cli("export", tiny_llama, "--kv", "int3", "--out", tmp_path / "o"), "unknown KV scheme")
    assert not (tmp_path / "o").exists()


def test_help_shows_defaults():
    r = run_edgekv("generate", "--help")
    assert r.returncode == 0
    assert "--max-new-tokens" in r.stdout and "default: 256" in r.stdout


def test_library_errors_name_the_setting_and_the_cli_names_the_flag(tiny_bundle_int8):
    from edgekv.cli import FLAGS, explain
    from edgekv.errors import SETTINGS, ContextOverflow

    assert set(FLAGS) == set(SETTINGS)  # every setting an error can name has its flag
    e = ContextOverflow("context full", setting="capacity", fix="raise {}")
    assert str(e) == "context full" and e.explain() == "context full (raise the cache capacity)"
    assert explain(e) == "context full (raise --ctx)"
    r = cli("generate", tiny_bundle_int8, "capital of France " * 40, "--ctx", "32")
    assert_clean_error(r, "cache holds 32 (raise --ctx, up to 256)")


def test_library_code_raises_no_flags():
    """Below the command line (format, runtime, chat) an error's message names no flag; a shell
    command to run (in backticks) may."""
    import ast
    import re

    from tests.conftest import ROOT

    flagged = []
    for layer in ("format", "runtime", "chat"):
        for path in sorted((ROOT / "edgekv" / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                    text = "".join(c.value for c in ast.walk(node.exc.args[0])
                                   if isinstance(c, ast.Constant) and isinstance(c.value, str))
                    if re.search(r"--[a-z]", re.sub(r"`[^`]*`", "", text)):
                        flagged.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert flagged == []


def test_version():
    r = run_edgekv("--version")
    assert r.returncode == 0 and r.stdout.startswith("edgekv ") and r.stdout.split()[1][0].isdigit(), r


def test_float_range_message_balanced(tiny_bundle_int8):
    r = cli("generate", tiny_bundle_int8, "hi", "--top-p", "0")
    assert r.returncode == 2 and "(0, 1]" in r.stderr, r.stderr
    r = cli("generate", tiny_bundle_int8, "hi", "--temperature", "-1")
    assert r.returncode == 2 and "[0, 100]" in r.stderr, r.stderr


def test_non_utf8_prompt_is_one_line(tiny_bundle_int8):
    """Linux hands bytes that are not UTF-8 to Python as lone surrogates; the tokenizer cannot take them."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    for args in ([b"hi \xff there"], [b"hi", b"--system", b"\xfe\xff"]):
        cmd = [os.fsencode(sys.executable), b"-m", b"edgekv.cli", b"generate", os.fsencode(tiny_bundle_int8), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert_clean_error(r, "not valid UTF-8")


def test_generate_and_chat_defaults():
    """generate's and chat's sampling flags are unset: the model's defaults, as serve's requests
    (tests/test_sampling_defaults.py); the default model's keep the repeat guard (a bare question
    on the int4 bundle looped for 256 tokens without it)."""
    from edgekv.cli import build_parser
    from edgekv.runtime.sampling import defaults_of
    from export.model_sampling import manifest_sampling
    from export.recipes import locate_source

    g = build_parser().parse_args(["generate", "B", "hi"])
    c = build_parser().parse_args(["chat", "B"])
    assert (g.temperature, g.repeat_penalty, c.temperature, c.top_p, c.top_k, c.repeat_penalty) == (None,) * 6
    assert defaults_of({"sampling": manifest_sampling({}, locate_source(None)[1])}, g).repeat_penalty == 1.1
