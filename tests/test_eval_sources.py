"""eval compares bundles of one model made from different source files (a float and a quantized
GGUF of one checkpoint) and refuses bundles of different models: config or tokenizer differ."""
import hashlib
import json
import shutil

import pytest

from edgekv.errors import EdgeKVError
from edgekv.tools.evaluate import evaluate


def _copy_with(bundle, dest, source=None, tokenizer=None):
    shutil.copytree(bundle, dest)
    m = json.loads((dest / "edgekv.json").read_text())
    if source:
        m["source"] = {**m.get("source", {}), **source}
    if tokenizer:  # a changed tokenizer, its size and sha256 recorded as an export would
        path = dest / m["files"]["tokenizer"]
        t = json.loads(path.read_text())
        tokenizer(t)
        path.write_text(json.dumps(t))
        for key, value in (("sizes", path.stat().st_size), ("sha256", hashlib.sha256(path.read_bytes()).hexdigest())):
            if path.name in m["files"].get(key, {}):
                m["files"][key][path.name] = value
    (dest / "edgekv.json").write_text(json.dumps(m))
    return dest


def test_another_file_of_the_same_model_is_compared_and_said(tiny_bundle_int8, tmp_path, capsys):
    other = _copy_with(tiny_bundle_int8, tmp_path / "other", source={"sha256": "0" * 64, "file": "other.gguf"})
    import io
    out = io.StringIO()
    evaluate([str(tiny_bundle_int8), str(other)], "x y z " * 200, ctx=32, chunks=1, out=out)
    assert "different source files of one model" in out.getvalue() and "other.gguf" in out.getvalue()


def test_a_different_tokenizer_is_another_model(tiny_bundle_int8, tmp_path):
    def rename_a_token(t):
        vocab = t["model"]["vocab"]
        if isinstance(vocab, dict):
            k = next(iter(vocab))
            vocab[k + "_x"] = vocab.pop(k)
        else:  # unigram: [[piece, score], ...]
            vocab[0][0] += "_x"
    other = _copy_with(tiny_bundle_int8, tmp_path / "other", source={"sha256": "0" * 64}, tokenizer=rename_a_token)
    with pytest.raises(EdgeKVError, match="different source models"):
        evaluate([str(tiny_bundle_int8), str(other)], "x y z " * 200, ctx=32, chunks=1)
