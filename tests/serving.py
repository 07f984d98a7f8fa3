"""One way for the serve tests to run a server: a started batcher and an app on 127.0.0.1, both
stopped at the end (tests/test_serve_http.py, test_serve_hardening.py, test_serve_structured.py,
test_reasoning.py); and one schedule of requests joining and leaving a batch, stepped by hand
(tests/test_serve_engine.py, test_fused_serve.py)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import pytest

from edgekv.runtime.batching import Request
from edgekv.serve.app import Server
from edgekv.serve.listen import BackgroundServer
from edgekv.serve.server import build


class Served(NamedTuple):
    server: Server | None  # None: an app made by build() (the product's path)
    batcher: object
    url: str


@contextmanager
def served_app(batcher, app, server: Server | None = None):
    """Serve `app` over the started `batcher`; the HTTP server closed, then the batcher stopped."""
    try:
        srv = BackgroundServer(app)
    except BaseException:
        batcher.stop()
        raise
    try:
        yield Served(server, batcher, srv.url)
    finally:
        srv.close()
        batcher.stop()


def serving(rt, codec=None, with_bundle: bool = True, capacity: int = 256, parallel: int = 4, max_queue: int = 64,
            prefill_chunk: int = 32, **server_kw):
    """A Server over a fresh batcher of `capacity` cells (codec: the runtime's unless given; the
    bundle drives tools, response_format and logprobs unless `with_bundle` is false)."""
    batcher = rt.batcher(capacity=capacity, parallel=parallel, max_queue=max_queue, prefill_chunk=prefill_chunk)
    batcher.start()
    try:
        server = Server(batcher, codec or rt.codec, rt.bundle.manifest["name"],
                        bundle=rt.bundle if with_bundle else None, **server_kw)
    except BaseException:
        batcher.stop()
        raise
    return served_app(batcher, server.app(), server)


def built(rt, **build_kw):
    """The app `edgekv serve` builds (serve/server.py's build), served."""
    return served_app(*build(rt, **build_kw))


def run_until_done(engine, reqs, max_steps=2000):
    """Step `engine` until every request in `reqs` has finished (a bound: one that never does fails)."""
    for _ in range(max_steps):
        if all(r.finish_reason for r in reqs):
            return
        engine.step()
    raise AssertionError("requests did not finish")


class Staggered(NamedTuple):
    reqs: dict  # name -> its Request (logits recorded)
    mixed: bool  # a step after C joined prefilled it beside A's decode
    first_cells: dict  # name -> its first cell one step after it joined (on slots: its slot's); None: not admitted


def staggered(engine, spec: dict, prefill_steps: int) -> Staggered:
    """spec: name -> (prompt, max_tokens) for A, B, C, D. A alone first, B joins after 3 steps,
    C one step later with a prompt longer than a chunk, prefilled over the `prefill_steps` steps
    watched beside A's and B's decodes; B finishes early, D joins after; run until all are done."""
    reqs = {k: Request(p, n, record_logits=True) for k, (p, n) in spec.items()}
    first, c_len = {}, len(spec["C"][0])

    def join(name, steps):
        """Submit `name` and step `steps` times: whether one of them prefilled C beside A's decode."""
        engine.submit(reqs[name])
        mixed = False
        for k in range(steps):
            engine.step()
            if k == 0:
                seq = reqs[name].seq
                first[name] = seq.cells[0] if seq is not None else None
            mixed |= 0 < reqs["C"].fed < c_len and reqs["A"].next_token is not None
        return mixed

    join("A", 3)
    join("B", 1)
    mixed = join("C", prefill_steps)
    while not reqs["B"].finish_reason:
        engine.step()
    join("D", 1)
    run_until_done(engine, list(reqs.values()))
    return Staggered(reqs, mixed, first)


# A ChatML template that takes `tools` (so the prompt is the template's, not the generic
# format's long system message) and renders them, calls and results in a few tokens: a tool
# round trip fits the tiny bundles' 256 cells (tests/test_api_*.py)
TOOLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
                  "{{ c.function.arguments }}</tool_call>{% endfor %}{% endif %}{{ m['content'] or '' }}<|im_end|>\n"
                  "{% endfor %}{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} "
                  "{% endfor %}<|im_end|>\n{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def with_template(bundle, folder, template: str):
    """A copy of `bundle` in `folder` whose manifest names `template` as its chat template."""
    import json
    import shutil

    shutil.copytree(bundle, folder)
    man = json.loads((folder / "edgekv.json").read_text())
    (folder / "edgekv.json").write_text(json.dumps({**man, "chat_template": template}))
    return folder


@pytest.fixture(scope="module")
def url(rt_int8):
    """A server of the tiny int8 bundle, per module (tests/test_api_*.py)."""
    with serving(rt_int8) as s:
        yield s.url


@pytest.fixture(scope="module")
def tools_url(tiny_bundle_int8, tmp_path_factory):
    """The tiny bundle with a template that takes tools in a few tokens (TOOLS_TEMPLATE)."""
    from edgekv.runtime.assemble import open_runtime

    folder = with_template(tiny_bundle_int8, tmp_path_factory.mktemp("tools") / "b", TOOLS_TEMPLATE)
    with open_runtime(folder, ctx=256, backend="ort-cpu", threads=1) as r, serving(r) as s:
        yield s.url


def greedy_chat(url: str, body: dict) -> dict:
    """A chat completion at temperature 0 through HTTP (the oracle the other APIs are held to)."""
    import httpx

    r = httpx.post(url + "/v1/chat/completions", json={"temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()
