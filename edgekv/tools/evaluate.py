"""`edgekv eval`: accuracy against KV memory, per KV scheme.

The text goes through the runtime and its quantized cache in chunks (every token attends to the
quantized past, as in decode; chunked = token-by-token because new K/V are quantized before
attention). Like llama-perplexity, each window of --ctx tokens is scored on its second half
(every scored token has at least ctx/2 tokens of context). The float-weights float-KV bundle's
log-probs are the reference (without one, the most float bundle's, and the output says so) (llama-perplexity's --kl-divergence-base): computed once per window and every other
scheme is compared with them: KL divergence, top-1 agreement, ΔPPL."""
from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgekv.errors import EdgeKVError, note
from edgekv.format.files import atomic_open, make_folders, write_bytes, write_json, write_text
from edgekv.format.bundle import Bundle, load_bundle
from edgekv.format.kvschemes import float16_bytes_per_token
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.backends.base import PREFILL_CHUNK, default_threads
from edgekv.runtime.batching.stream import Stream
from edgekv.tools.corpus import default_text
from edgekv.runtime.text import TextCodec
from edgekv.tools.bench import llama_cpp_gguf, peer_failure
from edgekv.runtime.cpu import cpu_field, describe as describe_cpu


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@dataclass
class SchemeResult:
    name: str
    scheme: str
    bytes_per_token: int
    weights: str = "float"  # stored weight format
    weight_bytes: int = 0   # the weights as stored (stored_weight_bytes): the same for the same weights
    graph_bytes: int = 0    # the graph file on disk (the weights and the KV scheme's constants): what the runtime holds
    nll: list = field(default_factory=list)  # per scored token
    kld: list = field(default_factory=list)
    top1: list = field(default_factory=list)
    tag: str = ""  # what tables and the plot call it, when not its weights/scheme (llama.cpp)

    @property
    def label(self) -> str:
        return self.tag or (self.scheme if self.weights == "float" else f"w{self.weights}/{self.scheme}")

    def ppl(self) -> tuple[float, float]:
        """PPL and its standard error (delta method on the mean NLL, as llama-perplexity)."""
        nll = np.asarray(self.nll)
        mean = nll.mean()
        err = nll.std(ddof=1) / math.sqrt(len(nll)) if len(nll) > 1 else 0.0
        p = math.exp(mean)
        return p, p * err


class LlamaCppWindows:
    """llama.cpp (llama-cpp-python, the bench extra) scoring a window like run_window: the same
    token ids, its own weights, activations and f16 KV cache. A reference point, never the
    reference: it is not a bundle of the model, only the model's GGUF."""

    def __init__(self, gguf: Path, ctx: int, threads: int | None, vocab: int):
        from edgekv.tools.llama_cpp_bench import load_for_scoring

        self.llm = load_for_scoring(gguf, ctx, threads, vocab)

    def __call__(self, ids: list[int], first_scored: int) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids[:-1])
        return log_softmax(np.asarray(self.llm.scores[first_scored: len(ids) - 1], np.float32))


def check_llama_cpp_runs(gguf: Path, ctx: int, threads: int | None, vocab: int) -> None:
    """llama.cpp loaded and run on one short window in a child process first (llama_cpp_bench
    --probe): a build that dies of a signal there (an illegal instruction: GGML_NATIVE=ON on a
    CPU whose VM does not enable all it reports) is one line, not the end of this eval. A child
    that merely fails leaves the error to the load here, which says it in its own words."""
    cmd = [sys.executable, "-m", "edgekv.tools.llama_cpp_bench", str(gguf), "--probe", "--n-ctx", str(ctx),
           "--threads", str(threads or 0), "--vocab", str(vocab)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode < 0:
        raise EdgeKVError(f"--llama-cpp: {peer_failure(p)}")


def run_window(stream: Stream, ids: list[int], first_scored: int) -> np.ndarray:
    """Log-probs [n_scored, V] for predicting ids[first_scored+1:] from the window's prefix."""
    stream.reset()
    # through the cache in chunks; the lm_head runs only on the scored rows
    return log_softmax(stream.prefill(ids[:-1], all_logits=True, logits_from=first_scored))


def evaluate(paths: list[str], text: str | None = None, ctx: int = 1024, chunks: int | None = None,
             threads: int | None = None, prefill_chunk: int = PREFILL_CHUNK, out=sys.stdout, stride: int | None = None,
             llama_cpp: Path | None = None) -> dict:
    bundles = [load_bundle(p) for p in paths]
    _check_same_model(bundles, out)
    codec = TextCodec(bundles[0])
    if text is None:
        text, text_desc = default_text()
    else:
        text_desc = "user file"
    ids = codec.encode(text)
    if len(ids) < ctx + 1:
        raise EdgeKVError(f"text too short: {len(ids)} tokens, one window needs {ctx + 1}", setting="capacity",
                          fix="use a longer text or a smaller {}")
    stride = stride or ctx + 1  # default: windows do not overlap
    starts = list(range(0, len(ids) - ctx, stride))
    if chunks:
        starts = starts[:chunks]
    # the float-weights float-KV bundle is the reference; without one, the most float one is
    order = sorted(range(len(bundles)), key=lambda i: (bundles[i].weights != "float", bundles[i].scheme.name != "float"))
    runtimes, runners, results = [], [], []
    try:
        for b in bundles:
            if ctx > b.max_context:
                raise EdgeKVError(f"a window of {ctx} tokens exceeds {b.path.name}'s verified context {b.max_context}",
                                  setting="capacity", fix="use a smaller {}")
            rt = open_runtime(b, ctx, "auto", threads, max_logits_rows=prefill_chunk, log=None)
            runtimes.append(rt)
            stream = rt.stream(prefill_chunk=prefill_chunk)
            runners.append(functools.partial(run_window, stream))
            # a windowed cache (Gemma 3's local layers keep their window): what it holds per token at ctx
            per_token = b.kv_bytes_per_token() if stream.cache.local_ring is None else round(stream.cache.nbytes / ctx)
            results.append(SchemeResult(b.path.name, b.scheme.name, per_token, b.weights,
                                        stored_weight_bytes(b), b.graph_bytes()))
        if llama_cpp is not None:  # scored after every bundle, compared with the same reference
            m = bundles[0].model
            check_llama_cpp_runs(llama_cpp, ctx, threads, m["vocab_size"])
            runners.append(LlamaCppWindows(llama_cpp, ctx, threads, m["vocab_size"]))
            results.append(SchemeResult(llama_cpp.name, "f16", float16_bytes_per_token(
                m["n_layers"], m["n_kv_heads"], m["head_dim"]), "gguf", llama_cpp.stat().st_size, tag="llama.cpp"))
            order.append(len(runners) - 1)
        return score_windows(bundles, runners, results, ids, starts, order, ctx, text_desc, out,
                             threads or default_threads())
    finally:
        for rt in runtimes:
            rt.close()


def stored_weight_bytes(b: Bundle) -> int:
    """The weights as the bundle stores them (the manifest's weights.bytes: the same for every KV
    scheme of the same weights); for a bundle of an older exporter, its graph files, which also
    hold the KV scheme's constants."""
    n = b.manifest["weights"].get("bytes")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else b.graph_bytes()


def reference_note(results: list[SchemeResult], ref_i: int, n_bundles: int) -> str | None:
    """One line when the reference is not what the numbers would be assumed to be against."""
    ref = results[ref_i]
    if n_bundles == 1:
        return (f"  one bundle: {ref.name} is its own reference (KLD 0 and top-1 100 % by construction); give a "
                f"float-weights float-KV bundle of the same model too to measure it")
    if (ref.weights, ref.scheme) != ("float", "float"):
        return (f"  no float-weights float-KV bundle given: the reference is the most float one, {ref.name} "
                f"({describe(ref)})")
    return None


def describe(r: SchemeResult) -> str:
    """A result's weights and KV scheme in words: what a KLD is measured against."""
    return f"{r.weights} weights + {r.scheme} KV"


def score_windows(bundles, runners, results, ids, starts, order, ctx, text_desc, out, threads: int) -> dict:
    n_windows, first, ref_i = len(starts), ctx // 2, order[0]
    print(f"edgekv eval: {len(bundles)} bundle(s), {n_windows} windows of {ctx} tokens ({len(ids)} tokens of "
          f"{text_desc}), scoring the second half of each; reference: {results[ref_i].name}", file=out, flush=True)
    print(f"  cpu: {describe_cpu(threads)}", file=out, flush=True)  # the running times below are this CPU's
    why = reference_note(results, ref_i, len(bundles))
    if why:
        print(why, file=out, flush=True)
    t0 = time.time()
    for w in range(n_windows):
        win = ids[starts[w]: starts[w] + ctx + 1]
        targets = np.asarray(win[first + 1:])
        ref_lp = None
        for i in order:
            lp = runners[i](win, first)
            r = results[i]
            r.nll.extend((-lp[np.arange(len(targets)), targets]).tolist())
            if i == ref_i:
                ref_lp = lp
                r.kld.extend([0.0] * len(targets))
                r.top1.extend([1.0] * len(targets))
            else:
                p = np.exp(ref_lp)
                r.kld.extend((p * (ref_lp - lp)).sum(-1).tolist())
                r.top1.extend((ref_lp.argmax(-1) == lp.argmax(-1)).astype(float).tolist())
        line = "  ".join(f"{r.label} {r.ppl()[0]:.4f}" for r in results)
        print(f"[{w + 1}/{n_windows}] {time.time() - t0:.0f}s  running PPL: {line}", file=out, flush=True)
    return {**summarize(bundles, results, ref_i, ctx, text_desc, n_windows, out), "cpu": cpu_field(threads)}


def _check_same_model(bundles: list[Bundle], out=sys.stdout) -> None:
    """One model: the same config and the same tokenizer. Different source files of it (a float and
    a Q4_K_M GGUF of one checkpoint) are compared, with a line saying so: the KLD shows the rest."""
    if len({(json.dumps(b.model, sort_keys=True), _tokenizer_sha(b)) for b in bundles}) > 1:
        raise EdgeKVError(f"bundles come from different source models and cannot be compared: {_sources(bundles)}")
    if len({b.manifest.get("source", {}).get("sha256") for b in bundles}) > 1:
        print(f"  note: different source files of one model (the same config and tokenizer): {_sources(bundles)}",
              file=out)


def _tokenizer_sha(b: Bundle) -> str:
    return hashlib.sha256(b.tokenizer_path.read_bytes()).hexdigest()


def _sources(bundles: list[Bundle]) -> str:
    return ", ".join(f"{b.path.name} ({b.manifest.get('source', {}).get('file')})" for b in bundles)


def summarize(bundles, results, ref_i, ctx, text_desc, n_windows, out) -> dict:
    ref = results[ref_i]
    ref_ppl, _ = ref.ppl()
    m = bundles[0].model
    f16 = float16_bytes_per_token(m["n_layers"], m["n_kv_heads"], m["head_dim"])
    rows = []
    for r in results:
        p, e = r.ppl()
        kld = np.asarray(r.kld)
        row = {"bundle": r.name, "label": r.label, "scheme": r.scheme, "ppl": p, "ppl_err": e, "dppl": p - ref_ppl,
               "dppl_pct": 100 * (p - ref_ppl) / ref_ppl, "kld_mean": float(kld.mean()),
               "kld_err": float(kld.std(ddof=1) / math.sqrt(len(kld))) if len(kld) > 1 else 0.0,
               "kld_p99": float(np.percentile(kld, 99)), "top1_pct": 100 * float(np.mean(r.top1)),
               "kv_bytes_per_token": r.bytes_per_token, "kv_vs_fp16": r.bytes_per_token / f16,
               "kv_mib_at_ctx": r.bytes_per_token * ctx / 2**20, "weights": r.weights,
               "weights_mib": r.weight_bytes / 2**20,
               "total_mib_at_ctx": ((r.graph_bytes or r.weight_bytes) + r.bytes_per_token * ctx) / 2**20,
               "saving_vs_fp16_pct": 100 * (1 - r.bytes_per_token / f16), "tokens_scored": len(r.nll)}
        rows.append(row)
        print(f"\n{r.label} ({r.name})", file=out)
        print(f"  PPL = {p:.4f} ± {e:.4f}   ΔPPL = {row['dppl']:+.4f} ({row['dppl_pct']:+.3f} %)", file=out)
        print(f"  mean KLD = {row['kld_mean']:.6f} ± {row['kld_err']:.6f}   KLD p99 = {row['kld_p99']:.6f}   "
              f"top-1 agreement = {row['top1_pct']:.2f} %", file=out)
        print(f"  KV {r.bytes_per_token} B/token ({row['kv_vs_fp16']:.3f}x fp16), {row['kv_mib_at_ctx']:.2f} MiB at "
              f"ctx {ctx}, {saving(row['kv_vs_fp16'])}", file=out)
        print(f"  weights {r.weights}: {row['weights_mib']:.1f} MiB; total {row['total_mib_at_ctx']:.1f} MiB at ctx {ctx} "
              f"(the graph file, its constants included, + the KV cache)",
              file=out)
    return {"ctx": ctx, "windows": n_windows, "text": text_desc, "reference": ref.name,
            "reference_is": describe(ref), "fp16_bytes_per_token": f16, "results": rows}


def saving(vs_fp16: float) -> str:
    """The KV cache's bytes against an fp16 cache, in words (a float32 cache saves nothing: 2x)."""
    if vs_fp16 < 1:
        return f"saving vs fp16 {100 * (1 - vs_fp16):.1f} %"
    if vs_fp16 == 1:
        return "no saving vs fp16 (the same bytes)"
    return f"no saving vs fp16 ({vs_fp16:.2f}x its bytes)"


def plot_labels(res: dict) -> tuple[str, str, str]:
    """The plot's x label, y label and title: the KLD is against the run's own reference."""
    ref = res.get("reference_is", "the reference")
    return (f"memory: graph file (weights and constants) + KV cache at ctx {res['ctx']} (MiB)",
            f"mean KLD vs {ref} (log)",
            f"Accuracy vs memory — ctx {res['ctx']}, {res['windows']} windows; reference {res['reference']}")


def write_outputs(res: dict, json_path: str | None, plot_path: str | None) -> list[str]:
    written = []
    if json_path:
        base = Path(json_path)
        write_json(base, res)  # its folder made; the .csv and .md go beside it
        stem = base.with_suffix("")
        with atomic_open(stem.with_suffix(".csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(res["results"][0]))
            w.writeheader()
            w.writerows(res["results"])
        write_text(stem.with_suffix(".md"), markdown_table(res))
        written += [str(base), str(stem.with_suffix(".csv")), str(stem.with_suffix(".md"))]
    if plot_path:
        plot(res, plot_path)
        written.append(plot_path)
    return written


def markdown_table(res: dict) -> str:
    lines = [f"KV schemes on {res['text']}, ctx {res['ctx']}, {res['windows']} windows "
             f"(reference: {res['reference']})", "",
             "| weights | KV scheme | PPL | ΔPPL % | mean KLD | KLD p99 | top-1 % | KV B/token | × fp16 | KV MiB @ ctx "
             "| weights MiB | total MiB @ ctx |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["results"]:
        lines.append(f"| {r['weights']} | {r['scheme']} | {r['ppl']:.4f} ± {r['ppl_err']:.4f} | {r['dppl_pct']:+.3f} | "
                     f"{r['kld_mean']:.2e} | {r['kld_p99']:.2e} | {r['top1_pct']:.2f} | {r['kv_bytes_per_token']} | "
                     f"{r['kv_vs_fp16']:.3f} | {r['kv_mib_at_ctx']:.2f} | {r['weights_mib']:.1f} | "
                     f"{r['total_mib_at_ctx']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgeKVError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    rows = sorted(res["results"], key=lambda r: (r["total_mib_at_ctx"], r["kld_mean"]))
    floor = min([r["kld_mean"] for r in rows if r["kld_mean"] > 0] or [1e-4]) / 10
    for r in rows:
        x = r["total_mib_at_ctx"]
        y = r["kld_mean"] if r["kld_mean"] > 0 else floor  # the reference has KLD 0: drawn on the floor
        ax.scatter(x, y, s=60, zorder=3)
        name = r["label"]
        label = (f"{name} (reference)" if r["kld_mean"] == 0
                 else f"{name}  ΔPPL {r['dppl_pct']:+.2f}%  top-1 {r['top1_pct']:.1f}%")
        near = [q["kld_mean"] for q in rows if abs(q["total_mib_at_ctx"] - x) < 0.03 * x]
        above = r["kld_mean"] >= max(near)  # of points at about the same memory, label the top one above
        ax.annotate(label, (x, y), textcoords="offset points", fontsize=8.5, xytext=(10, 8 if above else -16))
    ax.set_yscale("log")
    xlabel, ylabel, title = plot_labels(res)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlim(0, max(r["total_mib_at_ctx"] for r in res["results"]) * 1.6)
    fig.tight_layout()
    make_folders(Path(path).parent)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_bytes(path, png.getvalue())


def cmd_eval(args) -> int:
    text = None
    if args.text:
        p = Path(args.text)
        if not p.is_file():
            raise EdgeKVError(f"{p}: no such text file")
        text = p.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise EdgeKVError(f"{p}: the text file is empty")
    gguf = llama_cpp_gguf(args.llama_cpp) if args.llama_cpp is not None else None
    res = evaluate(args.bundles, text, args.ctx, args.chunks, args.threads, stride=args.stride, llama_cpp=gguf)
    for f in write_outputs(res, args.json, args.plot):
        note(f"wrote {f}")
    return 0
