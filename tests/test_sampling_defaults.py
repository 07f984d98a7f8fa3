"""Model-default sampling (issue 43 item 3): what a request, `edgekv generate` or `edgekv chat`
that sets no sampling gets. Read at export from the recipe, a Hugging Face folder's
generation_config.json or a GGUF's general.sampling keys; recorded in the manifest (editable);
flags over it; OpenAI's defaults only where nothing gives one."""
import argparse
import json
import shutil

import pytest

from edgekv.errors import BundleError, ExportError
from edgekv.runtime.sampling import UNRECORDED, SamplingDefaults, defaults_of
from tests.conftest import cli

KEYS = ("temperature", "top_p", "top_k", "repeat_penalty")


def values(d) -> tuple:
    return tuple(getattr(d, k) for k in KEYS)


def flags(**set_) -> argparse.Namespace:
    return argparse.Namespace(**{k: set_.get(k) for k in KEYS})


def manifest_of(src, recipe=None) -> dict:
    from export.manifest import build_manifest

    return build_manifest(src, recipe or {"name": "t"}, "int8", "float32", 256)


# -- where the model's defaults come from ------------------------------------------------------

def test_hf_generation_config_is_recorded(tiny_llama, tmp_path):
    from export.loaders import load_hf_folder

    folder = shutil.copytree(tiny_llama, tmp_path / "hf")
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    man = manifest_of(load_hf_folder(folder))
    d = defaults_of(man)
    assert values(d) == (0.6, 0.95, 20, 1.05)
    assert "generation_config.json" in man["sampling"]["source"] and "generation_config.json" in d.source


def test_hf_do_sample_false_is_greedy():
    from export.model_sampling import from_generation_config

    assert from_generation_config({"do_sample": False, "temperature": 0.7})["temperature"] == 0.0
    kept = from_generation_config({"temperature": 0.3, "top_p": 1.5})  # a value out of range is left out, said
    assert kept["temperature"] == 0.3 and "top_p" not in kept and "top_p = 1.5" in kept["source"]


def test_a_model_without_defaults_gets_openais(tiny_bundle_int8):
    """The tiny checkpoint's generation_config.json has no sampling keys: OpenAI's, and the
    manifest (written by the export) says why."""
    from edgekv.format.bundle import load_bundle

    man = load_bundle(tiny_bundle_int8).manifest
    assert "none in generation_config.json" in man["sampling"]["source"]
    d = defaults_of(man)
    assert values(d) == (1.0, 1.0, 0, 1.0) and "OpenAI" in d.source


def test_gguf_sampling_keys_are_recorded(tiny_llama, tmp_path, monkeypatch):
    import gguf

    from export.gguf_loader import load_gguf
    from tests.test_gguf import write_gguf

    header = gguf.GGUFWriter.write_header_to_file

    def with_sampling(self, *a, **kw):  # llama.cpp's general.sampling keys, as a model's GGUF may carry them
        self.add_sampling_temp(0.6)
        self.add_sampling_top_p(0.95)
        self.add_sampling_top_k(20)
        self.add_sampling_penalty_repeat(1.05)
        return header(self, *a, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_sampling)
    write_gguf(tiny_llama, tmp_path / "s.gguf")
    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", header)
    write_gguf(tiny_llama, tmp_path / "plain.gguf")
    man = manifest_of(load_gguf(tmp_path / "s.gguf"))
    assert values(defaults_of(man)) == (0.6, 0.95, 20, 1.05)  # float32 in the file, 0.6 in the manifest
    assert "general.sampling" in man["sampling"]["source"]
    plain = manifest_of(load_gguf(tmp_path / "plain.gguf"))
    assert plain["sampling"] == {"source": "no general.sampling keys in the GGUF"}
    assert values(defaults_of(plain)) == (1.0, 1.0, 0, 1.0)


def test_the_recipe_gives_the_model_cards_defaults():
    """The default recipe (its GGUF and generation_config.json carry none) records the model
    card's temperature 0.2, top_p 0.9 and edgekv's repeat guard; a recipe's sampling wins over
    the source's."""
    from export.model_sampling import manifest_sampling
    from export.recipes import locate_source

    _, recipe = locate_source(None)
    rec = manifest_sampling({"source": "no general.sampling keys in the GGUF"}, recipe)
    d = defaults_of({"sampling": rec})
    assert values(d) == (0.2, 0.9, 0, 1.1)
    assert "models/smollm2-135m-instruct.json" in d.source and "model card" in d.source
    over = manifest_sampling({"temperature": 0.6, "top_k": 20, "source": "generation_config.json"}, recipe)
    assert values(defaults_of({"sampling": over})) == (0.2, 0.9, 0, 1.1)


def test_a_bad_recipe_is_refused_before_loading(tmp_path, monkeypatch):
    from export import recipes

    monkeypatch.setattr(recipes, "MODELS_DIR", tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({"source": {"package": "nope", "file": "x", "install": "-"},
                                                 "sampling": {"temperature": -1}}))
    with pytest.raises(ExportError, match=r"recipe r: sampling.temperature = -1 is outside"):
        recipes.locate_source("r")


# -- precedence: flag > manifest > OpenAI ------------------------------------------------------

def test_flags_over_the_manifest_over_openai_key_by_key():
    man = {"sampling": {"temperature": 0.2, "top_p": 0.9, "source": "recipe"}}
    assert values(defaults_of(man, flags())) == (0.2, 0.9, 0, 1.0)  # top_k, repeat_penalty: OpenAI's
    d = defaults_of(man, flags(temperature=0.7))
    assert values(d) == (0.7, 0.9, 0, 1.0) and d.source.startswith("--temperature 0.7 over the model's")
    assert defaults_of(man, flags(temperature=0.0)).temperature == 0.0  # an explicit 0 is greedy, not "unset"
    assert values(defaults_of(man, flags(top_p=1.0, top_k=5, repeat_penalty=1.2))) == (0.2, 1.0, 5, 1.2)
    assert values(defaults_of({"sampling": {}})) == values(SamplingDefaults())  # nothing gives one: OpenAI's


def test_a_bundle_without_the_field_keeps_generates_old_default():
    """An older export (no `sampling`): greedy with the repeat guard, in every command, and the
    load line says to re-export or edit the manifest."""
    d = defaults_of({})
    assert values(d) == tuple(UNRECORDED[k] for k in KEYS) == (0.0, 1.0, 0, 1.1)
    assert "re-export" in d.source and "greedy" in d.line()


def test_a_bad_manifest_value_is_one_clear_error():
    for bad, said in (({"temperature": "hot"}, "sampling.temperature is str"), ({"top_p": 0}, "sampling.top_p = 0"),
                      ({"top_k": 1.5}, "sampling.top_k is float"), ({"min_p": 0.1}, "sampling.min_p is not one of"),
                      ([0.2], "sampling is list")):
        with pytest.raises(BundleError, match="corrupt manifest") as e:
            defaults_of({"sampling": bad})
        assert said in str(e.value)


def test_the_flags_default_to_unset_and_say_so():
    from edgekv.cli import build_parser

    for cmd in (["generate", "B", "hi"], ["chat", "B"], ["serve", "B"]):
        a = build_parser().parse_args(cmd)
        assert values(a) == (None,) * 4, cmd
        set_ = build_parser().parse_args(cmd + ["--temperature", "0", "--top-p", "0.5"])
        assert (set_.temperature, set_.top_p) == (0.0, 0.5)
    r = cli("serve", "--help")
    assert "--temperature" in r.stdout and "--top-p" in r.stdout and "the model's" in r.stdout
    bad = cli("serve", "B", "--top-p", "0")
    assert bad.returncode == 2 and "--top-p: must be a number in (0, 1]" in bad.stderr


# -- an edited manifest, and the three commands agree ------------------------------------------

@pytest.fixture
def edited(bundle_copy):
    """The tiny bundle with its manifest's `sampling` edited by hand (as docs/models.md says)."""
    path = bundle_copy / "edgekv.json"
    man = json.loads(path.read_text())
    man["sampling"] = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "repeat_penalty": 1.2, "source": "edited"}
    path.write_text(json.dumps(man))
    return bundle_copy


def sampled_with(monkeypatch) -> list:
    """Every SamplingParams the runtime samples a token with (the batcher's post-processing, every command's)."""
    import edgekv.runtime.batching.postprocess as post

    seen = []
    real = post.sample
    monkeypatch.setattr(post, "sample", lambda logits, p, *a: (seen.append(p), real(logits, p, *a))[1])
    return seen


def test_an_edited_manifest_stays_valid(edited):
    r = cli("verify", edited)  # the manifest is not among the files it hashes
    assert r.returncode == 0, r.stderr


def test_generate_chat_and_serve_agree_on_unset(edited, monkeypatch):
    httpx = pytest.importorskip("httpx")
    from edgekv.runtime.assemble import open_runtime
    from tests.serving import built

    seen = sampled_with(monkeypatch)
    want = (0.5, 0.8, 7, 1.2)
    r = cli("generate", edited, "hi", "--max-new-tokens", "2", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    assert {values(p) for p in seen} == {want}, "generate"
    seen.clear()
    r = cli("chat", edited, "--max-new-tokens", "2", "--threads", "1", input="hi\n")
    assert r.returncode == 0, r.stderr
    assert {values(p) for p in seen} == {want}, "chat"
    seen.clear()
    with open_runtime(edited, ctx=256, backend="ort-cpu", threads=1) as rt, built(rt) as s:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert {values(p) for p in seen} == {want}, "serve"
    seen.clear()
    # a flag set wins over the manifest, key by key; --temperature 0 is greedy
    r = cli("generate", edited, "hi", "--max-new-tokens", "2", "--threads", "1", "--temperature", "0", "--top-k", "3")
    assert r.returncode == 0, r.stderr
    assert {values(p) for p in seen} == {(0.0, 0.8, 3, 1.2)}
