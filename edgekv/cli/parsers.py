"""`edgekv`'s argument parser: one small function per command, in the order `edgekv --help`
lists them (COMMAND_PARSERS)."""
from __future__ import annotations

import argparse

from edgekv.chat.policies import CONTEXT_POLICIES
from edgekv.cli.args import (CTX, THREADS, TOKENS, Formatter, Parser, add_runtime, add_sampling, float_range, int_list,
                             int_range, kv_scheme)
from edgekv.format.bundle import DTYPES, WEIGHT_FORMATS
from edgekv.format.kvschemes import SCHEMES
from edgekv.runtime.backends import BACKENDS
from edgekv.runtime.cpu import llama_cpp_cmake_args
from edgekv.tools.host import NEIGHBOURS


# the help texts several commands share
BUNDLE = "bundle folder written by `edgekv export`"
CPU_THREADS = "CPU threads (default: OMP_NUM_THREADS where set, else every CPU available)"
# the build flags for this host's CPU, as bench.LLAMA_CPP_FLAGS (tests/test_bench_llama_cpp.py holds them equal)
LLAMA_CPP_BUILT = (f'llama-cpp-python, the `bench` extra, built with CMAKE_ARGS="{llama_cpp_cmake_args()}" '
                   '(this CPU\'s: python -m edgekv.runtime.cpu)')


def _command(sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """A command's parser, with the help formatter every command uses."""
    return sub.add_parser(name, formatter_class=Formatter, help=help, description=description)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("edgekv")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="edgekv", formatter_class=Formatter,
                                 description="Small chat LLMs with an INT8 KV cache, from workstation export to Jetson.")
    ap.add_argument("--version", action="version", version=f"edgekv {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for add in COMMAND_PARSERS:
        add(sub)
    return ap


def _export_parser(sub) -> None:
    p = _command(sub, "export", help="checkpoint -> verified bundle (needs torch)",
                 description="Export a model to a bundle: ONNX graph with an explicit KV cache, tokenizer, "
                             "manifest. ONNX is checked against PyTorch before anything is written.")
    p.add_argument("model", nargs="?", default=None,
                   help="recipe name from models/, a Hugging Face folder, or a .gguf file (default: smollm2-135m-instruct)")
    p.add_argument("--kv", default="auto", type=kv_scheme, metavar="SCHEME",
                   help="KV scheme: auto | " + " | ".join(SCHEMES) + " (auto: int8-static, the fused attention's scheme, "
                        "where its calibration keeps perplexity within 0.3 %% of a float cache on held-out text, else int8)")
    p.add_argument("--calib-text", default=None, metavar="FILE",
                   help="calibration text for int8-static / int8-tensor (default: docstrings of stdlib modules)")
    p.add_argument("--calib-tokens", type=int_range(64, TOKENS), default=4096, help="calibration tokens used at most")
    p.add_argument("--out", default=None, help="bundle folder (default: models/bundles/NAME-KV, + -wFORMAT for quantized "
                   "weights); an old bundle there is replaced, its folder's other files (notes, engines/) stay")
    p.add_argument("--force", action="store_true",
                   help="export into a --out folder that holds other files (they are moved aside, not deleted)")
    p.add_argument("--max-context", type=CTX, default=None, help="longest context the bundle is verified for (default: recipe, else min(model, 4096))")
    p.add_argument("--dtype", default=DTYPES[0], choices=DTYPES,
                   help="weights and compute dtype: float32 for CPU bundles, float16 for GPU (TensorRT) bundles")
    p.add_argument("--weights", default="auto", choices=("auto", *WEIGHT_FORMATS),
                   help="stored weights: auto keeps what the source holds (a GGUF's own 4-bit blocks -> int4, Q8_0 -> "
                        "int8, float sources -> float); int4 keeps a GGUF's own Q4_0/Q4_1 blocks exactly (else symmetric "
                        "groups with a clip search); int8 per block of 32 (a GGUF's Q8_0 exactly); the embedding/head at "
                        "8 bits (docs/weights.md)")
    p.add_argument("--group", type=int, default=32, choices=[32, 64, 128],
                   help="int4 group size along the input dimension, for weights requantized from float")
    p.add_argument("--requant-method", default="awq", choices=["awq", "clip", "rtn"],
                   help="int4 requantized from float: activation-aware scales (AWQ, on the calibration text) + a "
                        "clip search per group; the clip search alone; or plain round-to-nearest (for comparison)")
    p.add_argument("--requantize", action="store_true",
                   help="requantize from the dequantized float even where the source has its own blocks (for comparison)")
    p.add_argument("--steps", type=int_range(1, 4096), default=32, help="decode steps in the parity check")
    p.add_argument("--threads", type=THREADS, default=None, help="CPU threads for the check")


def _generate_parser(sub) -> None:
    p = _command(sub, "generate", help="answer one prompt, streaming",
                 description="Stream the answer to one prompt, then print time to first token, decode tokens/s "
                             "and KV cache bytes.")
    p.add_argument("bundle", help=BUNDLE)
    p.add_argument("prompt", help="the user message (or raw text with --raw)")
    p.add_argument("--max-new-tokens", type=int_range(1, TOKENS), default=256, help="stop after this many new tokens")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--system", default=None, help="system message (default: the template's own)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g = p.add_mutually_exclusive_group()  # the answer constrained (llguidance, the serve extra)
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="answer with JSON that validates against this JSON Schema (docs/structured.md)")
    g.add_argument("--grammar", default=None, metavar="FILE.lark", help="answer in this Lark grammar's language")
    g.add_argument("--regex", default=None, metavar="R", help="answer with text this regex matches whole")
    add_sampling(p)
    add_runtime(p)


def _eval_parser(sub) -> None:
    p = _command(sub, "eval", help="perplexity, KLD and top-1 vs the float cache, per KV scheme",
                 description="Accuracy against KV memory: run the same text through each bundle's quantized cache; "
                             "PPL, ΔPPL, KL divergence and top-1 agreement against the float bundle; a table and a plot.")
    p.add_argument("bundles", nargs="+", help="bundles of one source model, e.g. NAME-float NAME-int8 ...")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: the stdlib's pydoc_data topics text)")
    p.add_argument("--ctx", type=int_range(2, TOKENS), default=1024, help="window (and cache) length; the second half is scored")
    p.add_argument("--stride", type=int_range(1, TOKENS), default=None,
                   help="window start step in tokens (default: ctx + 1, no overlap)")
    p.add_argument("--chunks", type=int_range(1, 1 << 30), default=None, help="evaluate at most this many windows (default: all)")
    p.add_argument("--llama-cpp", nargs="?", const="", default=None, metavar="GGUF",
                   help=f"also score llama.cpp ({LLAMA_CPP_BUILT}) on GGUF (default: the default model's) on the same "
                        "windows and token ids, against the same reference")
    p.add_argument("--threads", type=THREADS, default=None, help=CPU_THREADS)
    p.add_argument("--json", default=None, metavar="OUT", help="write OUT (.json) plus .csv and .md beside it")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write the accuracy-vs-memory plot")


def _eval_context_parser(sub) -> None:
    p = _command(sub, "eval-context", help="ring vs drop-turns when a chat outgrows the cache",
                 description="Generate a long greedy conversation with the whole history in the cache, then score its "
                             "replies under each context-full policy at --ctx: KL divergence and top-1 agreement "
                             "against the full-history model, reply perplexity, prefill tokens per turn.")
    p.add_argument("bundle", help=BUNDLE)
    p.add_argument("--ctx", type=int_range(8, TOKENS), default=512, help="the cache capacity the policies run in")
    p.add_argument("--turns", type=int_range(1, 10000), default=24, help="conversation turns (built-in questions)")
    p.add_argument("--reply-tokens", type=int_range(1, TOKENS), default=96, help="longest reply in the reference conversation")
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own)")
    p.add_argument("--sinks", type=int_range(0, TOKENS), default=None, help="ring: cells kept at the start (default: the system prompt's tokens)")
    p.add_argument("--threads", type=THREADS, default=None, help=CPU_THREADS)
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")


def _check_trt_parser(sub) -> None:
    p = _command(sub, "check-trt", help="hold a graph against TensorRT's ONNX parser rules",
                 description="Check every node of a bundle's graph (or an .onnx file) against the ONNX parser "
                             "rules of a TensorRT version: ops, types, build-time constants, Q/DQ, UINT8, opset.")
    p.add_argument("bundle", help="bundle folder or .onnx file")
    p.add_argument("--trt", default="10.3", help="TensorRT version whose rules apply (10.3 = JetPack 6; 10.15)")


def _build_engine_parser(sub) -> None:
    p = _command(sub, "build-engine", help="build the TensorRT engine (on the device)",
                 description="Build a bundle's TensorRT engine on this GPU (strongly typed; decode and prefill "
                             "profiles with the past from 0 to --ctx), cached under BUNDLE/engines/ and rebuilt "
                             "only when stale. Needs TensorRT and cuda-python (JetPack has both).")
    p.add_argument("bundle", help="bundle folder written by `edgekv export` (best: --dtype float16)")
    p.add_argument("--ctx", type=CTX, default=None, help="largest KV cache capacity the engine serves (default: min(2048, bundle max))")
    p.add_argument("--max-prefill", type=int_range(1, 1 << 16), default=256, help="most tokens per prefill call")
    p.add_argument("--workspace-mib", type=int_range(1, 1 << 20), default=1024, help="TensorRT tactic workspace limit")
    p.add_argument("--force", action="store_true", help="rebuild even if a fresh engine is cached")


def _chat_parser(sub) -> None:
    p = _command(sub, "chat", help="streaming multi-turn chat in the terminal",
                 description="Multi-turn chat that keeps its KV cache between turns. With stdin not a terminal, "
                             "each input line is one user turn (answers on stdout, stats on stderr).\n\n"
                             "commands: /help /reset /undo /system TEXT /stats /save FILE /load FILE /quit")
    p.add_argument("bundle", help=BUNDLE)
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's own)")
    p.add_argument("--max-new-tokens", type=int_range(1, TOKENS), default=512, help="longest reply in tokens")
    p.add_argument("--json", action="store_true", help="one JSON object per turn on stdout")
    p.add_argument("--context", default=CONTEXT_POLICIES[0], choices=CONTEXT_POLICIES,
                   help="when the conversation outgrows --ctx: ring = keep the system prompt, overwrite the oldest "
                        "tokens (StreamingLLM); drop-turns = drop whole old exchanges and re-prefill (docs/chat.md)")
    p.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="save the system prompt's KV here after its first prefill; restore it on later starts "
                        "(checked against the bundle and the system prompt; a stale file is rebuilt)")
    p.add_argument("--thinking", default="show", choices=("show", "hide", "off"),
                   help="a reply's <think> part (Qwen3, SmolLM3): show = dimmed, hide = not printed (both: the "
                        "template's default mode), off = the template is asked for no thinking (enable_thinking=false)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="every reply is JSON that validates against this JSON Schema (llguidance, the serve extra; "
                        "docs/structured.md)")
    add_sampling(p)
    add_runtime(p)


def _bench_parser(sub) -> None:
    p = _command(sub, "bench", help="time to first token, decode tokens/s, memory",
                 description="Benchmark a bundle: TTFT and decode tokens/s at batch 1 for several prompt lengths "
                             "and capacities, KV memory, peak RSS. Medians of --repeat runs. Several bundles: "
                             "each in its own process, then one table (with --llama-cpp: ratios to it).")
    p.add_argument("bundle", nargs="+", help="bundle folder(s) written by `edgekv export`")
    p.add_argument("--prompt-lengths", type=int_list(1, TOKENS), default="64,1024", help="comma-separated prompt lengths")
    p.add_argument("--capacities", type=int_list(1, TOKENS), default="256,4096",
                   help="comma-separated cache capacities (--ctx)")
    p.add_argument("--fill", type=int_list(1, TOKENS), default="64,1800",
                   help="context fill levels at which decode speed is measured")
    p.add_argument("--decode-tokens", type=int_range(1, TOKENS), default=64, help="tokens decoded per measurement")
    p.add_argument("--rss-tokens", type=int_range(1, TOKENS), default=1000, help="tokens decoded while watching RSS")
    p.add_argument("--repeat", type=int_range(1, 1000), default=3, help="runs per measurement (the median is reported)")
    p.add_argument("--threads", type=THREADS, default=None, help=CPU_THREADS)
    p.add_argument("--backend", default="ort-cpu", choices=BACKENDS, help="backend to time")
    p.add_argument("--attention", type=lambda t: [x.strip() for x in t.split(",")], default=None, metavar="LIST",
                   help="time each of these ort-cpu attentions (auto, fused, plain: EDGEKV_ATTENTION) in its own process, "
                        "taking turns with llama.cpp for --repeat rounds; ratios are medians of per-round ratios")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON here")
    p.add_argument("--neighbour", choices=NEIGHBOURS, default="none",
                   help="time beside another process, as a Jetson's other pipelines run beside the model: steady "
                        "(one core kept busy) or bursty (every core busy 0.2 s in each 0.5 s); llama.cpp beside the same")
    p.add_argument("--transformers", default=None, metavar="MODEL",
                   help="also time HF transformers (eager, same weights, same threads) on MODEL (a recipe, folder or "
                        ".gguf; workstation only: runs `python -m export.bench_transformers` in a subprocess)")
    p.add_argument("--llama-cpp", nargs="?", const="", default=None, metavar="GGUF",
                   help=f"also time llama.cpp ({LLAMA_CPP_BUILT}) on GGUF (default: the default model's "
                        "SmolLM2-135M-Instruct.Q4_1.gguf) with the same prompts, fills and threads, in a subprocess (a "
                        "crash of it is one line), and print the ratios")


SLOTS_HELP = ("K: fused slots, llama-server's --parallel K (K sequences of --ctx/K cells each, attention by "
              "onnxruntime's GroupQueryAttention over the static int8 cache; prefixes copied, not shared); "
              "0: the shared cell pool (the graph as written); auto (default): slots, K = --parallel, "
              "where the bundle's KV scheme is static int8 and ort-cpu fuses it, else the cell pool")


def slots_arg(text: str):
    """--slots: auto, or a count 0..1024 (argparse's message names both)."""
    try:
        return text if text == "auto" else int_range(0, 1024)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be auto or an integer in 0..1024 (got {text[:40]!r})") from None


def _serve_parser(sub) -> None:
    p = _command(sub, "serve", help="OpenAI-compatible HTTP server (the serve extra)",
                 description="Serve a bundle over HTTP: /v1/chat/completions, /v1/completions, /v1/models, "
                             "/health, /metrics. Requests are decoded together over one shared KV pool of "
                             "--ctx cells, or in fused slots of it (--slots; docs/serve.md).")
    p.add_argument("bundle", help=BUNDLE)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond localhost: set --api-key)")
    p.add_argument("--port", type=int_range(0, 65535), default=8080, help="port to listen on")
    p.add_argument("--parallel", type=int_range(1, 1024), default=4, help="sequences decoded together at most")
    p.add_argument("--slots", type=slots_arg, default="auto", metavar="K|auto", help=SLOTS_HELP)
    p.add_argument("--full-kv", action="store_true",
                   help="Gemma 3 (sliding-window layers) in the cell pool: keep every position of the local layers "
                        "too (more memory; the prefix cache then reuses any cached prefix, not only whole cached "
                        "prompts: docs/serve.md, \"Windowed KV\")")
    p.add_argument("--prefix-windows", type=int_range(0, 1024), default=None, metavar="N",
                   help="Gemma 3 in the windowed cell pool: cached prefixes whose local layers' window is kept (a "
                        "copy of a ring each; 0: no prefix cache; default: as many as keep the pool under the full "
                        "one's bytes, at most --parallel)")
    p.add_argument("--queue", type=int_range(0, 1 << 20), default=64,
                   help="requests that may wait for room; more get HTTP 429 (0: none wait, a request that can start "
                        "at once still starts)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1 and /metrics; repeat for several keys (each "
                        "client's prefixes kept apart). Visible in the process list: prefer --api-key-file")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API keys, one per line (blank lines and # comments skipped), besides any --api-key")
    p.add_argument("--max-body", type=int_range(1024, 1 << 30), default=1 << 20, metavar="BYTES",
                   help="largest request body; a larger one gets HTTP 413")
    p.add_argument("--read-timeout", type=float_range(0, 3600, lo_open=True), default=15.0, metavar="SECONDS",
                   help="time a client has to send a whole request (headers and body) after connecting or after its "
                        "previous reply; then the connection is closed (slow clients, slowloris)")
    p.add_argument("--drain-seconds", type=float_range(0, 24 * 3600), default=30.0, metavar="SECONDS",
                   help="on SIGTERM or SIGINT: answer new requests 503, let running ones finish for at most this "
                        "long, then exit 0; a second signal stops at once")
    p.add_argument("--quiet", action="store_true", help="no access log (one line per request on stderr)")
    add_sampling(p, serve=True)  # what a request that sets no sampling gets, over the model's defaults
    add_runtime(p, ctx_help="KV cells shared by all requests (default: min(2048, bundle max))")


BENCH_APIS = ("chat", "messages", "responses")


def api_list(text: str) -> list[str]:
    """bench-serve --api: a comma-separated list of BENCH_APIS, each once."""
    apis = [a.strip() for a in text.split(",")]
    if not apis or any(a not in BENCH_APIS for a in apis) or len(set(apis)) != len(apis):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of {', '.join(BENCH_APIS)} (each once)")
    return apis


def _bench_serve_parser(sub) -> None:
    p = _command(sub, "bench-serve", help="concurrent streaming clients against serve",
                 description="Start the server in-process and stream from 1, 2, 4, 8 concurrent clients: "
                             "aggregate and per-client tokens/s, TTFT p50/p95, peak RSS, KV cells; and the "
                             "TTFT of a second request sharing a long system prompt.")
    p.add_argument("bundle", help=BUNDLE)
    p.add_argument("--clients", type=int_list(1, 1024), default="1,2,4,8", help="comma-separated concurrency levels")
    p.add_argument("--tokens", type=int_range(1, TOKENS), default=128, help="tokens per client")
    p.add_argument("--system-tokens", type=int_range(1, TOKENS), default=500, help="length of the shared system prompt")
    p.add_argument("--url", default=None, help="bench this OpenAI-compatible server instead (e.g. llama_cpp.server)")
    p.add_argument("--pid", type=int_range(1, 2**31 - 1), default=None, help="with --url: the server's process id, for its RSS")
    p.add_argument("--soak", type=int_range(0, 1 << 20), default=200, help="short requests sent at the end while watching RSS")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON here")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="instead: each level's requests with response_format this JSON Schema and the same requests "
                        "free, taking turns for --rounds rounds: decode tok/s of both, mask time per token "
                        "(docs/structured.md)")
    p.add_argument("--rounds", type=int_range(1, 100), default=3,
                   help="with --json-schema: rounds of the two; with several --api: rounds of them")
    p.add_argument("--api", type=api_list, default="chat", metavar="API[,API...]",
                   help="the API the clients stream through: chat (/v1/chat/completions), messages (Anthropic's "
                        "/v1/messages), responses (/v1/responses); several: each level through each, taking turns "
                        "for --rounds rounds, per-client tok/s of each (the same engine: they should agree)")
    p.add_argument("--slots", type=slots_arg, default="auto", metavar="K|auto",
                   help="where the in-process server keeps the requests' K/V, as serve's --slots (auto: K = the "
                        "largest --clients level)")
    add_runtime(p)


def _verify_parser(sub) -> None:
    p = _command(sub, "verify", help="check every file of a bundle against its sha256",
                 description="Hash every file of a bundle and compare it with the sha256 the export recorded in "
                             "the manifest (load checks only sizes). Files unchanged since the last successful "
                             "verify (same size, mtime, ctime and inode) are not hashed again unless --full.")
    p.add_argument("bundle", help=BUNDLE)
    p.add_argument("--full", action="store_true", help="hash every file, also those verified before")


# the commands' parsers, in the order `edgekv --help` lists them
COMMAND_PARSERS = (_export_parser, _generate_parser, _eval_parser, _eval_context_parser,
                   _check_trt_parser, _build_engine_parser, _chat_parser, _bench_parser,
                   _serve_parser, _bench_serve_parser, _verify_parser)
