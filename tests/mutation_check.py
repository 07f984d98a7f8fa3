"""Mutation check: does the suite catch one-line bugs of the kinds a careless edit introduces?

Each mutation below replaces one exact piece of source text (which must occur exactly once) in a
temporary copy of the repository; the listed tests then run there (pytest -x, with a timeout).
A failing run means the mutation was caught; a passing one, that it survived. Not collected by
pytest (no test_ prefix); run it from the repository root:

    python tests/mutation_check.py                      # every mutation
    python tests/mutation_check.py --only chat          # names or areas containing "chat"
    python tests/mutation_check.py --list               # the table, without running anything

Before the mutations, each distinct set of tests runs once on the unmutated copy: a set that
fails there would "catch" everything, so its mutations are reported as unusable instead. An entry
whose file or text is not in the code (or whose tests do not exist) is an error: the run stops
before any test, listing every such entry (exit 2)."""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mutation:
    name: str
    area: str
    file: str
    old: str
    new: str
    tests: tuple  # test files (globs allowed) and pytest arguments such as "-k", "expr"


EVAL = ("tests/test_eval*.py",)
CTX_EVAL = ("tests/test_context_eval.py", "tests/test_eval*.py")
SAMPLING = ("tests/test_sampling.py", "tests/test_runtime.py", "tests/test_stream.py")
CALIB = ("tests/test_calibration.py", "tests/test_eval*.py")
TRT = ("tests/test_trt_check.py", "-k", "not every_scheme and not exported_bundles and not mutated_export "
                                          "and not jetson")
TRT_CLI = ("tests/test_trt_check.py", "-k", "cli")
TRT_W = ("tests/test_trt_check_weights.py", "-k", "not exported")
WEIGHTS_EVAL = ("tests/test_weights.py", "-k", "eval_reference")
CHAT = ("tests/test_chat_invariants.py", "tests/test_chat.py", "-m", "not slow")
GUARDS = ("tests/test_guards.py", "tests/test_runtime.py", "tests/test_backends.py", "tests/test_cli_errors.py")
BENCH = ("tests/test_bench.py", "tests/test_stream.py", "tests/test_runtime.py")

M = Mutation
SERVE_ENGINE = ("tests/test_serve_engine.py", "-k", "not real")
CAST_READS = ("tests/test_backends.py", "-k", "cast_with_the_same_logits or unit_scalar")

TRT_FAKE = ("tests/test_trt_fake.py",)
W_TRT = ("tests/test_weights.py", "-k", "tensorrt or engine_build or gguf_blocks or tied")
AWQ = ("tests/test_awq.py",)

MUTATIONS = [
    # -- this stop: 8-bit blocks, trt serving, AWQ
    M("trt: writes inside the past not staged", "trt", "edgekv/runtime/backends/trt.py",
      "stage = self._staging(cache) if write < past else None", "stage = None", TRT_FAKE),
    M("trt: staged K/V copied one slot late", "trt", "edgekv/runtime/backends/trt.py",
      "check(self.rt.cudaMemcpyAsync(cache.ptr(name, write), stage[name].ptr",
      "check(self.rt.cudaMemcpyAsync(cache.ptr(name, write + 1), stage[name].ptr", TRT_FAKE),
    M("trt profiles stop one cell short of the pool", "trt", "edgekv/runtime/backends/engines.py",
      "decode = profile(s=(1, 1, 1), k=(1, 1, 1), p=(0, opt_past, ctx))",
      "decode = profile(s=(1, 1, 1), k=(1, 1, 1), p=(0, opt_past, ctx - 1))", TRT_FAKE),
    M("engine step larger than the backend's call", "serve", "edgekv/runtime/engine.py",
      "budget = min(self.prefill_chunk, self.backend.max_tokens_per_call - len(pieces))",
      "budget = self.prefill_chunk", TRT_FAKE),
    M("tensorrt graph: per-channel scale from the row, not the column", "trt", "edgekv/runtime/backends/engines.py",
      "s = np.maximum(np.abs(w).max(0), 1e-12) / 127.0  # [N]", "s = np.maximum(np.abs(w).max(), 1e-12) / 127.0 + 0 * np.abs(w).max(0)", W_TRT),
    M("engine build parses the stored graph", "trt", "jetson/build_engine.py",
      "    converted = tensorrt_graph(model, path.parent)\n    if converted:",
      "    converted = []\n    if converted:", W_TRT),
    M("tied head requantized instead of the table's blocks", "weights", "export/bundle.py",
      '            kept["lm_head.weight"] = kept["embed.weight"]', '            pass', W_TRT),
    M("awq: down's scale folded into the gate rows", "weights", "export/awq.py",
      "            w[inter:] /= s[:, None]", "            w[:inter] /= s[:, None]", AWQ),
    M("awq: q|k|v scale not folded into its norm", "weights", "export/awq.py",
      'norms[f"{layer}.attn_norm.weight"] = norms[f"{layer}.attn_norm.weight"] / s',
      'norms[f"{layer}.attn_norm.weight"] = norms[f"{layer}.attn_norm.weight"]', AWQ),
    # -- evaluation
    M("eval --llama-cpp scores the rows one position late", "eval", "edgekv/tools/evaluate.py",
      "self.llm.scores[first_scored: len(ids) - 1]", "self.llm.scores[first_scored + 1: len(ids)]",
      ("tests/test_eval_llama_cpp.py",)),
    M("eval --llama-cpp takes another model's GGUF", "eval", "edgekv/tools/evaluate.py",
      "if self.llm.n_vocab() != vocab:", "if self.llm.n_vocab() < vocab:", ("tests/test_eval_llama_cpp.py",)),
    M("bench-serve --json without its folder", "serve", "edgekv/serve/bench.py",
      "write_json(args.json, res)", "open(args.json, \"w\").write(json.dumps(res))", ("tests/test_serve_bench.py",)),
    M("eval KLD direction", "eval", "edgekv/tools/evaluate.py",
      "r.kld.extend((p * (ref_lp - lp)).sum(-1).tolist())",
      "r.kld.extend((np.exp(lp) * (lp - ref_lp)).sum(-1).tolist())", EVAL),
    M("eval-context KLD direction", "eval", "edgekv/tools/context_eval.py",
      "kld.extend((np.exp(r) * (r - p)).sum(-1).tolist())",
      "kld.extend((np.exp(p) * (p - r)).sum(-1).tolist())", CTX_EVAL),
    M("eval NLL targets shifted by one", "eval", "edgekv/tools/evaluate.py",
      "targets = np.asarray(win[first + 1:])", "targets = np.asarray(win[first:-1])", EVAL),
    M("eval-context NLL targets shifted by one", "eval", "edgekv/tools/context_eval.py",
      "tgt = np.asarray(full_ids[s: s + n])", "tgt = np.asarray(full_ids[s - 1: s - 1 + n])", CTX_EVAL),
    M("eval reference is the first bundle, not the float one", "eval", "edgekv/tools/evaluate.py",
      'order = sorted(range(len(bundles)), key=lambda i: (bundles[i].weights != "float", bundles[i].scheme.name != "float"))',
      "order = list(range(len(bundles)))", EVAL),
    M("eval reference chosen by KV scheme only, not float weights", "eval", "edgekv/tools/evaluate.py",
      'key=lambda i: (bundles[i].weights != "float", bundles[i].scheme.name != "float"))',
      'key=lambda i: bundles[i].scheme.name != "float")', WEIGHTS_EVAL),
    M("eval top-1 compares with the wrong argmax", "eval", "edgekv/tools/evaluate.py",
      "(ref_lp.argmax(-1) == lp.argmax(-1))", "(ref_lp.argmax(-1) == ref_lp.argmax(-1))", EVAL),
    # -- sampling
    M("temperature multiplies", "sampling", "edgekv/runtime/sampling.py",
      "x = (logits - top) / p.temperature", "x = (logits - top) * p.temperature", SAMPLING),
    M("top-p keeps one token too few", "sampling", "edgekv/runtime/sampling.py",
      "return head[: min(int(np.searchsorted(cum, top_p)) + 1, m)]",
      "return head[: max(1, min(int(np.searchsorted(cum, top_p)), m))]", SAMPLING),
    M("top-p stops at a head too short", "sampling", "edgekv/runtime/sampling.py",
      "if m == w.shape[0] or cum[-1] >= top_p:", "if True:", SAMPLING),
    M("top-k keeps one token too many", "sampling", "edgekv/runtime/sampling.py",
      "np.partition(x, -p.top_k)[-p.top_k]", "np.partition(x, -p.top_k - 1)[-p.top_k - 1]", SAMPLING),
    M("the inverse CDF forgets the blocks before", "sampling", "edgekv/runtime/sampling.py",
      "target - (ends[b - 1] if b else 0.0))", "target)", SAMPLING),
    M("non-finite logits sampled", "sampling", "edgekv/runtime/sampling.py",
      "    if not np.isfinite(top):\n        raise", "    if False:\n        raise", SAMPLING),
    M("the inverse CDF may land past the last weight", "sampling", "edgekv/runtime/sampling.py",
      "min(max(target, 0.0), np.nextafter(cdf[-1], -np.inf))", "target", SAMPLING),
    M("repeat penalty raises negative logits", "sampling", "edgekv/runtime/sampling.py",
      "np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)",
      "np.where(vals > 0, vals / p.repeat_penalty, vals / p.repeat_penalty)", SAMPLING),
    M("repeat_last_n ignored", "sampling", "edgekv/runtime/sampling.py",
      "np.asarray(history[-p.repeat_last_n:], np.int64)", "np.asarray(history, np.int64)", SAMPLING),
    M("repeat_last_n 0 penalizes the whole history", "sampling", "edgekv/runtime/sampling.py",
      "if p.repeat_penalty != 1.0 and history and p.repeat_last_n > 0:",
      "if p.repeat_penalty != 1.0 and history:", SAMPLING),
    # (not listed: passing the generator's whole id list instead of seq.recent(n) is equivalent,
    # because sample() applies the repeat_last_n window itself)
    # -- calibration
    M("int8-static scales left at 1.0", "calibration", "export/calibrate.py",
      "getattr(layer.attn, name).copy_((a / 127.0).clamp(min=min_scale))",
      "getattr(layer.attn, name).fill_(1.0)", CALIB),
    M("int8-static scales divided by 128", "calibration", "export/calibrate.py",
      "getattr(layer.attn, name).copy_((a / 127.0).clamp(min=min_scale))",
      "getattr(layer.attn, name).copy_((a / 127.0 / 128).clamp(min=min_scale))", CALIB),
    M("int4 key offsets never set", "calibration", "export/calibrate.py",
      "a.k_offset.copy_(m @ a.had.float() if model.scheme.rotate else m)", "a.k_offset.zero_()", CALIB),
    M("int4 key offsets not rotated", "calibration", "export/calibrate.py",
      "a.k_offset.copy_(m @ a.had.float() if model.scheme.rotate else m)", "a.k_offset.copy_(m)", CALIB),
    # -- check-trt: each rule switched off
    M("check-trt: INT8 consumed by other than DequantizeLinear", "check-trt", "edgekv/tools/trt_check.py",
      'bad_use = [c for c in consumers.get(tname, []) if c.op_type != "DequantizeLinear"',
      "bad_use = [c for c in consumers.get(tname, []) if False", TRT),
    M("check-trt: INT8 produced other than by QuantizeLinear", "check-trt", "edgekv/tools/trt_check.py",
      "if not ok_src:", "if False:", TRT),
    M("check-trt: per-channel QuantizeLinear on an activation", "check-trt", "edgekv/tools/trt_check.py",
      'if per_channel and op == "QuantizeLinear" and n.input[0] not in constants:', "if False:", TRT),
    M("check-trt: per-channel Q refused on weights too", "check-trt", "edgekv/tools/trt_check.py",
      'if per_channel and op == "QuantizeLinear" and n.input[0] not in constants:',
      'if per_channel and op == "QuantizeLinear":', TRT),
    M("check-trt: per-channel DequantizeLinear on an activation", "check-trt", "edgekv/tools/trt_check.py",
      'if per_channel and op == "DequantizeLinear" and n.input[0] not in constants:', "if False:", TRT),
    M("check-trt: the input-type table", "check-trt", "edgekv/tools/trt_check.py",
      'if t and t not in rule["types"]:', "if False:", TRT),
    M("check-trt: Where typed by its condition", "check-trt", "edgekv/tools/trt_check.py",
      '_DATA_INPUT = {"Where": 1}', "_DATA_INPUT = {}", TRT),
    M("check-trt: no upper opset bound", "check-trt", "edgekv/tools/trt_check.py",
      'if not ver["min_opset"] <= o.version <= max_opset:', 'if not ver["min_opset"] <= o.version:', TRT),
    M("check-trt: no lower opset bound", "check-trt", "edgekv/tools/trt_check.py",
      'if not ver["min_opset"] <= o.version <= max_opset:', 'if not o.version <= max_opset:', TRT),
    M("check-trt: opset 21 for any graph under 10.3, INT4 or not", "check-trt", "edgekv/tools/trt_check.py",
      'max_opset = max(ver["max_opset"], ver["int4_opset"]) if int4 else ver["max_opset"]',
      'max_opset = max(ver["max_opset"], ver["int4_opset"])', TRT_W),
    M("check-trt: block-wise DQ of other than INT4", "check-trt", "edgekv/tools/trt_check.py",
      'if src != "INT4":', "if False:", TRT_W),
    M("check-trt: block-wise DQ on a runtime tensor", "check-trt", "edgekv/tools/trt_check.py",
      "if n.input[0] not in constants:\n        out.append(Violation(name, op, \"block-wise",
      "if False:\n        out.append(Violation(name, op, \"block-wise", TRT_W),
    M("check-trt: block-wise DQ on a 3-D weight", "check-trt", "edgekv/tools/trt_check.py",
      "elif len(shapes.get(n.input[0], [])) != 2:", "elif False:", TRT_W),
    M("check-trt: INT4 below opset 21", "check-trt", "edgekv/tools/trt_check.py",
      'if src == "INT4" and opset < ver["int4_opset"]:', "if False:", TRT_W),
    M("check-trt: UINT4 tensors", "check-trt", "edgekv/tools/trt_check.py", 'if t == "UINT4":', "if False:", TRT_W),
    M("check-trt: INT8 Gather on a runtime table", "check-trt", "edgekv/tools/trt_check.py",
      'if n.input[0] not in constants:\n        out.append(Violation(name, "Gather"',
      'if False:\n        out.append(Violation(name, "Gather"', TRT_W),
    M("check-trt: INT8 gathered rows used outside DQ", "check-trt", "edgekv/tools/trt_check.py",
      'if c.op_type != "DequantizeLinear":\n            out.append(Violation(c.name, c.op_type, f"consumes the INT8 rows',
      'if False:\n            out.append(Violation(c.name, c.op_type, f"consumes the INT8 rows', TRT_W),
    M("check-trt: foreign domain imports", "check-trt", "edgekv/tools/trt_check.py",
      'if o.domain in ("", "ai.onnx"):', 'if o.domain in ("", "ai.onnx") or True:', TRT),
    M("check-trt: custom-domain nodes", "check-trt", "edgekv/tools/trt_check.py",
      'if n.domain not in ("", "ai.onnx"):', "if False:", TRT),
    M("check-trt: ops missing from the table", "check-trt", "edgekv/tools/trt_check.py",
      "if op in unsup or op not in sup or op in not_yet:", "if op in unsup or op in not_yet:", TRT),
    M("check-trt: ops newer than the version", "check-trt", "edgekv/tools/trt_check.py",
      "if op in unsup or op not in sup or op in not_yet:", "if op in unsup or op not in sup:", TRT),
    M("check-trt: build-time constant inputs", "check-trt", "edgekv/tools/trt_check.py",
      "if k < len(n.input) and n.input[k] and n.input[k] not in constants:", "if False:", TRT),
    M("check-trt: Cast from a quantized type", "check-trt", "edgekv/tools/trt_check.py",
      "if _TYPES.get(to) in _QUANTIZED or src in _QUANTIZED:", "if _TYPES.get(to) in _QUANTIZED:", TRT),
    M("check-trt: Cast to a quantized type", "check-trt", "edgekv/tools/trt_check.py",
      "if _TYPES.get(to) in _QUANTIZED or src in _QUANTIZED:", "if src in _QUANTIZED:", TRT),
    M("check-trt: Cast source types", "check-trt", "edgekv/tools/trt_check.py",
      'elif src and src not in rule["types"]:', "elif False:", TRT),
    M("check-trt: Q/DQ scales constant", "check-trt", "edgekv/tools/trt_check.py",
      'if ver["qdq_scale_must_be_constant"] and scale not in constants:', "if False:", TRT),
    M("check-trt: zero points constant", "check-trt", "edgekv/tools/trt_check.py",
      "if zp and zp not in constants:", "if False:", TRT),
    M("check-trt: DequantizeLinear input types", "check-trt", "edgekv/tools/trt_check.py",
      'if op == "DequantizeLinear" and src and src not in _QUANTIZED:', "if False:", TRT),
    M("check-trt: QuantizeLinear input types", "check-trt", "edgekv/tools/trt_check.py",
      'if op == "QuantizeLinear" and src and src not in ("FP32", "FP16", "BF16"):', "if False:", TRT),
    M("check-trt: UINT8 inside the network", "check-trt", "edgekv/tools/trt_check.py",
      'if t == "UINT8" and tname not in graph_io and tname not in constants:', "if False:", TRT),
    M("check-trt: an empty .onnx passes", "check-trt", "edgekv/tools/trt_check.py",
      "if not model.graph.node or not model.opset_import:", "if False:", TRT_CLI),
    # -- chat (a held sequence of the engine: its cells, ids and sinks change only through the
    # engine, so the bugs of a separate id list are bugs of those methods)
    M("chat: one stale slot kept after /undo", "chat", "edgekv/chat/session.py",
      "        self._keep_common_prefix(self.conv.render(self.conv.msgs(), self.seq.ids))\n        return True",
      "        held = self.seq.ids\n"
      "        self.engine.truncate(self.seq, min(len(held), common_prefix(held, self.conv.render(self.conv.msgs(), held)) + 1))\n"
      "        return True", CHAT),
    M("held: truncate keeps one stale id", "chat", "edgekv/runtime/engine.py",
      "h._set(cells[:n], h.ids[:n])", "h._set(cells[:n], h.ids[:n + 1])", CHAT),
    M("chat: the ring runs one position past the verified context", "chat", "edgekv/runtime/engine.py",
      "return min(cells, self.max_positions - self.pos)", "return min(cells, self.max_positions + 1 - self.pos)", CHAT),
    M("sequence: a call may run one position past the verified context", "chat", "edgekv/runtime/sequence.py",
      "if s > self.max_positions - self._pos:", "if s > self.max_positions + 1 - self._pos:",
      ("tests/test_runtime.py",)),
    M("sequence: truncate keeps one stale id", "runtime", "edgekv/runtime/sequence.py",
      "        del self._ids[n:]", "        del self._ids[n + 1:]", ("tests/test_runtime.py",)),
    M("sequence: a ring wraps back to slot 0, over its sinks", "runtime", "edgekv/runtime/sequence.py",
      "            self._w = self._sinks\n", "            self._w = 0\n", ("tests/test_runtime.py",)),
    M("chat: drop-turns drops one message", "chat", "edgekv/chat/conversation.py",
      "self.messages = self.messages[2:] if len(self.messages) >= 2 else []",
      "self.messages = self.messages[1:]", CHAT),
    M("chat: one sink slot too many", "chat", "edgekv/chat/policies.py",
      "        seq.enable_ring(sinks)\n", "        seq.enable_ring(sinks + 1)\n", CHAT),
    M("chat: sinks not capped at half the cache", "chat", "edgekv/chat/policies.py",
      "        if sinks > seq.capacity // 2:\n", "        if sinks > seq.capacity - 2:\n",
      ("tests/test_hardening.py",) + CHAT),
    M("chat: a rolled-back turn keeps the cells it took", "chat", "edgekv/runtime/engine.py",
      "        self.pool.set_state(turn.pool)\n", "", CHAT),
    M("chat: a rolled-back turn leaves the cells it overwrote", "chat", "edgekv/runtime/engine.py",
      "        for start, rows in turn.rows:", "        for start, rows in []:", ("tests/test_hardening.py",)),
    M("chat: load drops the wrapped ring's first ids", "chat", "edgekv/runtime/engine.py",
      "        h._set(cells, ids)\n", "        h._set(cells, ids[len(ids) - n:])\n", CHAT),
    M("held: a ring overwrites its sinks", "chat", "edgekv/runtime/engine.py",
      "        sinks = req.held.sinks\n", "        sinks = 0\n", CHAT),
    M("chat: the last token of a turn is not fed", "chat", "edgekv/runtime/engine.py",
      "        elif req.feed_last and self._can_feed(req):", "        elif False:",
      ("tests/test_bench.py", "-k", "chat_turn")),
    # -- guards
    M("engine chooser prefers the largest engine", "guards", "edgekv/runtime/backends/engines.py",
      'info["ctx"] < best[1]["ctx"]', 'info["ctx"] > best[1]["ctx"]', GUARDS),
    M("engine chooser takes one slot too few", "guards", "edgekv/runtime/backends/engines.py",
      'if info["ctx"] >= ctx and', 'if info["ctx"] >= ctx - 1 and', GUARDS),
    M("bundle file-size check removed", "guards", "edgekv/format/bundle.py",
      "if f.stat().st_size != size:", "if False:", GUARDS),
    M("free-memory check removed", "guards", "edgekv/runtime/cache.py",
      "if free is not None and need > free:", "if False:", GUARDS),
    M("free-memory check after allocating", "guards", "edgekv/runtime/cache.py",
      "        self.memory = memory or HostMemory()\n",
      "        self.memory = memory or HostMemory(); [self.memory.alloc(s, d) for s, d in shapes.values()]\n", GUARDS),
    M("--ctx one past max_context", "guards", "edgekv/runtime/cache.py",
      "if capacity > bundle.max_context:", "if capacity > bundle.max_context + 1:", GUARDS),
    M("prompt as long as the cache accepted", "guards", "edgekv/tools/generate.py",
      "if len(ids) >= gen.cache.capacity:", "if len(ids) > gen.cache.capacity:", GUARDS),
    M("cache room one too many", "guards", "edgekv/runtime/sequence.py",
      "if not self.ring and s > self.capacity - self._n:", "if not self.ring and s > self.capacity + 1 - self._n:",
      GUARDS),
    # -- bench / stats
    M("decode tok/s counts the first token", "bench", "edgekv/runtime/generate.py",
      "return self.decode_steps / self.decode_s", "return self.new_tokens / self.decode_s", BENCH),
    M("decode tok/s from shown tokens - 1 (a stop token's step not counted)", "bench", "edgekv/runtime/generate.py",
      "return self.decode_steps / self.decode_s", "return (self.new_tokens - 1) / self.decode_s", BENCH),
    M("bench decode rate counts one token more", "bench", "edgekv/tools/bench.py",
      "return t1 - t0, decode_tokens / (t2 - t1)", "return t1 - t0, (decode_tokens + 1) / (t2 - t1)", BENCH),
    M("bench comparison ratio against the wrong bundle's runs", "bench", "edgekv/tools/bench.py",
      'r["vs_llama_cpp"] = llama_cpp_ratios(r["runs"], lc["runs"]', 'r["vs_llama_cpp"] = llama_cpp_ratios(results[0]["runs"], lc["runs"]',
      ("tests/test_bench_llama_cpp.py", "-k", "several_bundles")),
    # -- serving engine (issue 13)
    M("a finished reply is not cached", "serve", "edgekv/runtime/engine.py",
      'if reason in ("stop", "length") and len(req.cells) > len(req.prompt):', 'if False:', SERVE_ENGINE),
    M("a cancelled reply is cached too", "serve", "edgekv/runtime/engine.py",
      'if reason in ("stop", "length") and len(req.cells) > len(req.prompt):',
      'if reason in ("stop", "length", "cancelled") and len(req.cells) > len(req.prompt):', SERVE_ENGINE),
    M("no compaction", "serve", "edgekv/runtime/engine.py",
      "        if self._bucket(reach) > self._bucket(int(pool.live().sum()) + want) or length < min(want, pool.free()):",
      "        if False:", SERVE_ENGINE),
    M("no compaction for a fragmented step", "serve", "edgekv/runtime/engine.py",
      " or length < min(want, pool.free()):", ":", SERVE_ENGINE),
    M("cached cells bound as the past", "serve", "edgekv/runtime/engine.py",
      "return self._bucket(self.pool.live_high_water())",
      "return self._bucket(int(np.flatnonzero(np.r_[1, self.pool.refs])[-1]))", SERVE_ENGINE),
    M("compaction moves no K/V rows", "serve", "edgekv/runtime/engine.py",
      "            self.cache.move_cells(moved, perm[moved])", "            pass", SERVE_ENGINE),
    M("compaction reads a cell after it was overwritten", "serve", "edgekv/runtime/memory.py",
      "        buf[dst] = buf[src]", "        for a, b in zip(src, dst): buf[b] = buf[a]", SERVE_ENGINE),
    M("compaction only where the step's cells land beyond the sequences'", "serve", "edgekv/runtime/engine.py",
      "reach = max(pool.live_high_water(), start + length)", "reach = pool.live_high_water()", SERVE_ENGINE),
    M("compaction leaves the prefix cache's cells unrenamed", "serve", "edgekv/runtime/pool.py",
      "            self.prefixes[key] = perm[cells]", "            pass", SERVE_ENGINE),
    M("compaction leaves a running request's cells unrenamed", "serve", "edgekv/runtime/engine.py",
      "            req.cells = perm[req.cells].tolist() if req.cells else []", "            pass", SERVE_ENGINE),
    M("a half-done past binding taken for done", "perf", "edgekv/runtime/backends/ort.py",
      '        self._bound.pop("past", None)  # a Ctrl-C half-way through leaves some bound, some not: rebind all next time\n',
      "", ("tests/test_decode_step.py",)),
    # -- the ort backend's Cast for the cache reads (issue 11)
    M("cache reads cast to the wrong type", "perf", "edgekv/runtime/backends/ort.py",
      "to = consts[node.input[1]].data_type", "to = onnx.TensorProto.FLOAT16", CAST_READS),
    M("a non-unit DQ read rewritten as Cast", "perf", "edgekv/runtime/backends/ort.py",
      "and len(node.input) >= 2 and is_scalar(node.input[1], 1.0)", "and len(node.input) >= 2", CAST_READS),
    M("a DQ read with a zero point rewritten as Cast", "perf", "edgekv/runtime/backends/ort.py",
      "or is_scalar(node.input[2], 0.0))", "or True)", CAST_READS),
]

_IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", "bundles", "*.egg-info",
                                 "bench-results", "eval-results")


def pytest_args(copy: Path, tests: tuple) -> list[str] | None:
    """The test spec with globs expanded in the copy; None if none of its files exist there."""
    out, files = [], 0
    it = iter(tests)
    for a in it:
        if a.startswith("-"):
            out += [a, next(it)]
            continue
        hits = sorted(glob.glob(str(copy / a)))
        files += len(hits)
        out += [str(Path(h).relative_to(copy)) for h in hits]
    return out if files else None


def run_tests(copy: Path, args: list[str], python: str, timeout: int) -> tuple[str, float]:
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    env.pop("CI", None)
    t0 = time.time()
    try:
        r = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args], cwd=copy, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.time() - t0
    if r.returncode == 0:
        return "passed", time.time() - t0
    if r.returncode == 5:
        return "no tests", time.time() - t0
    return "failed", time.time() - t0


def problem(copy: Path, m: Mutation) -> str | None:
    """Why `m` cannot run in `copy` (its file is gone, its text does not occur exactly once, or
    its tests do not exist), or None. A table entry that no longer matches the code is an error:
    skipping it would report a smaller table as a better score."""
    f = copy / m.file
    if not f.is_file():
        return f"{m.file} does not exist"
    n = f.read_text().count(m.old)
    if n != 1:
        return f"the text to replace occurs {n} times in {m.file} (must be once)"
    if pytest_args(copy, m.tests) is None:
        return f"no test files match {' '.join(m.tests)}"
    return None


def apply(copy: Path, m: Mutation) -> str:
    f = copy / m.file
    src = f.read_text()
    f.write_text(src.replace(m.old, m.new))
    return src


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the mutations whose name or area contains this (case-insensitive)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest (default: this one)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per test run (default: 600)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    a = ap.parse_args(argv)
    todo = [m for m in MUTATIONS if not a.only or a.only.lower() in (m.name + " " + m.area).lower()]
    if not todo:
        print(f"error: no mutation's name or area contains {a.only!r}", file=sys.stderr)
        return 2
    if a.list:
        for m in todo:
            print(f"[{m.area}] {m.name}: {m.file}: {m.old!r} -> {m.new!r}  ({' '.join(m.tests)})")
        return 0
    with tempfile.TemporaryDirectory(prefix="edgekv-mutants-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=_IGNORE)
        # every entry must apply before any test time is spent; all that do not are listed
        broken = [(m, why) for m in todo if (why := problem(copy, m))]
        if broken:
            for m, why in broken:
                print(f"error: mutation {m.name!r}: {why}", file=sys.stderr)
            return 2
        baseline: dict[tuple, str] = {}
        results = []
        for i, m in enumerate(todo, 1):
            args = pytest_args(copy, m.tests)
            if not a.no_baseline and m.tests not in baseline:
                baseline[m.tests], took = run_tests(copy, args, a.python, a.timeout)
                print(f"  baseline {' '.join(m.tests)}: {baseline[m.tests]} ({took:.0f}s)", flush=True)
            if baseline.get(m.tests, "passed") != "passed":
                results.append((m, "unusable (baseline " + baseline[m.tests] + ")", 0.0))
                continue
            original = apply(copy, m)
            try:
                outcome, took = run_tests(copy, args, a.python, a.timeout)
            finally:
                (copy / m.file).write_text(original)
            verdict = {"failed": "caught", "timeout": "caught (timeout)", "passed": "SURVIVED"}.get(outcome, outcome)
            results.append((m, verdict, took))
            print(f"[{i}/{len(todo)}] {verdict:<16} {m.name}  ({took:.0f}s)", flush=True)
    caught = [r for r in results if r[1].startswith("caught")]
    survived = [r for r in results if r[1] == "SURVIVED"]
    other = [r for r in results if not r[1].startswith("caught") and r[1] != "SURVIVED"]
    print(f"\n{len(results)} mutations, {len(caught)} caught, {len(survived)} survived, {len(other)} not run")
    for area in dict.fromkeys(m.area for m in todo):
        rs = [r for r in results if r[0].area == area]
        print(f"  {area:<12} {sum(r[1].startswith('caught') for r in rs)}/{len(rs)} caught")
    for m, v, _ in survived + other:
        print(f"  {v}: [{m.area}] {m.name} ({m.file})")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
