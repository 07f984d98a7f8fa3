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
SAMPLING_DEFAULTS = ("tests/test_sampling_defaults.py",)
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
STAMP = ("tests/test_stamp.py", "-k", "runs_as_the_traced_one")
W_TRT = ("tests/test_weights.py", "-k", "tensorrt or engine_build or gguf_blocks or tied")
AWQ = ("tests/test_awq.py",)

ENGINE_HARD = ("tests/test_engine_hardening.py",)
HTTP_H = ("tests/test_serve_hardening.py",)
LIFE = ("tests/test_serve_lifecycle.py",)
SERVER = "edgekv/serve/server.py"
INSTALL = "jetson/install-service.sh"
CHAT_H = ("tests/test_chat_hardening.py",)
EXPORT_H = ("tests/test_export_hardening.py",)
DISK = ("tests/test_disk_full.py",)
INT4_EXACT = ("tests/test_int4_determinism.py",)
FUSED = ("tests/test_fused.py",)
ARCH = ("tests/test_architectures.py",)
KQ = ("tests/test_gguf_kquants.py",)
GEMMA = ("tests/test_gemma3.py",)
GEMMA_WINDOW = ("tests/test_gemma3.py", "-k", "windowed or truncates")
SERVE_WINDOWED = ("tests/test_serve_windowed.py",)
GEMMA_POOL = ("tests/test_gemma3.py", "-k", "pool or rolled or truncates_within or starts_over or saves")
NBITS = ("tests/test_nbits.py",)
FP16 = ("tests/test_fp16_scales.py",)
FORMS = ("tests/test_weight_forms.py",)
FUSED_ARCHS = ("tests/test_fused_archs.py",)
FUSED_SERVE = ("tests/test_fused_serve.py",)
FUSED_CUDA = ("tests/test_fused_cuda.py",)

MUTATIONS = [
    # -- the review of the Messages and Responses APIs
    M("messages: a prefill not continued", "serve", "edgekv/serve/app.py",
      "text = self.render(c, plan) + c.prefill", "text = self.render(c, plan)",
      ("tests/test_api_messages.py", "-k", "final_assistant")),
    M("messages: thinking on unless asked off", "serve", "edgekv/serve/messages.py",
      "    if t is None:\n        return False", "    if t is None:\n        return None",
      ("tests/test_api_messages.py", "-k", "thinking")),
    M("messages: output_config ignored", "serve", "edgekv/serve/messages.py",
      "structured=tools_of(body) | output_format_of(body))", "structured=tools_of(body))",
      ("tests/test_api_messages.py", "-k", "structured_outputs")),
    M("responses: the cut item called completed", "serve", "edgekv/serve/responses.py",
      'item["status"] = "incomplete" if last and self.status() == "incomplete" else "completed"',
      'item["status"] = "completed"', ("tests/test_api_responses.py", "-k", "incomplete")),
    M("responses: no content part for reasoning", "serve", "edgekv/serve/responses.py",
      'if item["type"] in ("message", "reasoning"):', 'if item["type"] == "message":',
      ("tests/test_api_responses.py", "-k", "reasoning_item")),
    M("json integers left unbounded", "grammar", "edgekv/runtime/grammar_build.py",
      'if "integer" in kinds:', "if False:", ("tests/test_grammar_limits.py", "-k", "integer")),
    M("json integer bounds not reaching into anyOf", "grammar", "edgekv/runtime/grammar_build.py",
      'SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")', 'SCHEMA_LISTS = ("allOf", "oneOf", "prefixItems")',
      ("tests/test_grammar_limits.py", "-k", "integer")),
    # -- export --kv auto (issue 42 item 2)
    M("kv auto: a failed held-out check keeps int8-static", "export", "export/pipeline.py",
      'if opts.kv == AUTO and not check["passed"]:', "if False:", ("tests/test_kv_gate.py", "-k", "falls_back")),
    M("kv auto: the held-out check passes anything", "export", "export/kv_gate.py",
      '"passed": bool(delta <= BAR)}', '"passed": True}', ("tests/test_kv_gate.py", "-k", "falls_back or missed")),
    M("kv auto: the check scores the static model against itself", "export", "export/kv_gate.py",
      "ppl_float, ppl = math.exp(mean_nll(reference, ids, window)), math.exp(mean_nll(model, ids, window))",
      "ppl_float, ppl = math.exp(mean_nll(model, ids, window)), math.exp(mean_nll(model, ids, window))",
      ("tests/test_kv_gate.py", "-k", "keeps_static")),
    # -- this stop: 8-bit blocks, trt serving, AWQ
    M("trt: writes inside the past not staged", "trt", "edgekv/runtime/backends/trt.py",
      "stage = self._staging(cache) if write < past else None", "stage = None", TRT_FAKE),
    M("trt: staged K/V copied one slot late", "trt", "edgekv/runtime/backends/trt.py",
      "check(self.cudart.cudaMemcpyAsync(cache.ptr(name, write), stage[name].ptr",
      "check(self.cudart.cudaMemcpyAsync(cache.ptr(name, write + 1), stage[name].ptr", TRT_FAKE),
    M("trt profiles stop one cell short of the pool", "trt", "edgekv/runtime/backends/engines.py",
      "decode = profile(s=(1, 1, 1), k=(1, 1, 1), p=(0, opt_past, ctx))",
      "decode = profile(s=(1, 1, 1), k=(1, 1, 1), p=(0, opt_past, ctx - 1))", TRT_FAKE),
    M("engine step larger than the backend's call", 'serve', 'edgekv/runtime/batching/scheduler.py',
      'budget = min(self.prefill_chunk, self.max_tokens_per_call - len(pieces))', 'budget = self.prefill_chunk', ('tests/test_trt_fake.py',)),
    M("tensorrt graph: per-channel scale from the row, not the column", "trt", "edgekv/runtime/backends/engines.py",
      "s = np.maximum(np.abs(w).max(0), 1e-12) / 127.0  # [N]", "s = np.maximum(np.abs(w).max(), 1e-12) / 127.0 + 0 * np.abs(w).max(0)", W_TRT),
    M("engine build parses the stored graph", "trt", "jetson/build_engine.py",
      "    converted = per_channel(model, path.parent)\n    if converted:",
      "    converted = []\n    if converted:", W_TRT),
    M("tied head requantized instead of the table's blocks", "weights", "export/quantize.py",
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
    M("eval --llama-cpp takes another model's GGUF", "eval", "edgekv/tools/llama_cpp_bench.py",
      "if llm.n_vocab() != vocab:", "if llm.n_vocab() < vocab:", ("tests/test_eval_llama_cpp.py",)),
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
      "    if not np.isfinite(top):\n        raise ValueError(\"cannot sample", "    if False:\n        raise ValueError(\"cannot sample", SAMPLING),
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
      'a.v_scale.copy_(fit(c["v_headroom"] * v_all / 127.0))', "a.v_scale.fill_(1.0)", CALIB),
    M("int8-static scales divided by 128", "calibration", "export/calibrate.py",
      'a.v_scale.copy_(fit(c["v_headroom"] * v_all / 127.0))', 'a.v_scale.copy_(fit(c["v_headroom"] * v_all / 127.0 / 128))', CALIB),
    M("int4 key offsets never set", "calibration", "export/calibrate.py",
      "a.k_offset.copy_(m @ a.had.float() if model.scheme.rotate else m)", "a.k_offset.zero_()", CALIB),
    M("int4 key offsets not rotated", "calibration", "export/calibrate.py",
      "a.k_offset.copy_(m @ a.had.float() if model.scheme.rotate else m)", "a.k_offset.copy_(m)", CALIB),
    # -- check-trt: each rule switched off
    M("check-trt: INT8 consumed by other than DequantizeLinear", "check-trt", "edgekv/format/trt_rules.py",
      'bad_use = [c for c in consumers.get(tname, []) if c.op_type != "DequantizeLinear"',
      "bad_use = [c for c in consumers.get(tname, []) if False", TRT),
    M("check-trt: INT8 produced other than by QuantizeLinear", "check-trt", "edgekv/format/trt_rules.py",
      "if not ok_src:", "if False:", TRT),
    M("check-trt: per-channel QuantizeLinear on an activation", "check-trt", "edgekv/format/trt_rules.py",
      'if per_channel and op == "QuantizeLinear" and n.input[0] not in constants:', "if False:", TRT),
    M("check-trt: per-channel Q refused on weights too", "check-trt", "edgekv/format/trt_rules.py",
      'if per_channel and op == "QuantizeLinear" and n.input[0] not in constants:',
      'if per_channel and op == "QuantizeLinear":', TRT),
    M("check-trt: per-channel DequantizeLinear on an activation", "check-trt", "edgekv/format/trt_rules.py",
      'if per_channel and op == "DequantizeLinear" and n.input[0] not in constants:', "if False:", TRT),
    M("check-trt: the input-type table", "check-trt", "edgekv/format/trt_rules.py",
      'if t and t not in rule["types"]:', "if False:", TRT),
    M("check-trt: Where typed by its condition", "check-trt", "edgekv/format/trt_rules.py",
      '_DATA_INPUT = {"Where": 1}', "_DATA_INPUT = {}", TRT),
    M("check-trt: no upper opset bound", "check-trt", "edgekv/format/trt_rules.py",
      'if not ver["min_opset"] <= o.version <= max_opset:', 'if not ver["min_opset"] <= o.version:', TRT),
    M("check-trt: no lower opset bound", "check-trt", "edgekv/format/trt_rules.py",
      'if not ver["min_opset"] <= o.version <= max_opset:', 'if not o.version <= max_opset:', TRT),
    M("check-trt: opset 21 for any graph under 10.3, INT4 or not", "check-trt", "edgekv/format/trt_rules.py",
      'max_opset = max(ver["max_opset"], ver["int4_opset"]) if int4 else ver["max_opset"]',
      'max_opset = max(ver["max_opset"], ver["int4_opset"])', TRT_W),
    M("check-trt: block-wise DQ of other than INT4", "check-trt", "edgekv/format/trt_rules.py",
      'if src != "INT4":', "if False:", TRT_W),
    M("check-trt: block-wise DQ on a runtime tensor", "check-trt", "edgekv/format/trt_rules.py",
      "if n.input[0] not in constants:\n        out.append(Violation(name, op, \"block-wise",
      "if False:\n        out.append(Violation(name, op, \"block-wise", TRT_W),
    M("check-trt: block-wise DQ on a 3-D weight", "check-trt", "edgekv/format/trt_rules.py",
      "elif len(shapes.get(n.input[0], [])) != 2:", "elif False:", TRT_W),
    M("check-trt: INT4 below opset 21", "check-trt", "edgekv/format/trt_rules.py",
      'if src == "INT4" and opset < ver["int4_opset"]:', "if False:", TRT_W),
    M("check-trt: UINT4 tensors", "check-trt", "edgekv/format/trt_rules.py", 'if t == "UINT4":', "if False:", TRT_W),
    M("check-trt: INT8 Gather on a runtime table", "check-trt", "edgekv/format/trt_rules.py",
      'if n.input[0] not in constants:\n        out.append(Violation(name, "Gather"',
      'if False:\n        out.append(Violation(name, "Gather"', TRT_W),
    M("check-trt: INT8 gathered rows used outside DQ", "check-trt", "edgekv/format/trt_rules.py",
      'if c.op_type != "DequantizeLinear":\n            out.append(Violation(c.name, c.op_type, f"consumes the INT8 rows',
      'if False:\n            out.append(Violation(c.name, c.op_type, f"consumes the INT8 rows', TRT_W),
    M("check-trt: foreign domain imports", "check-trt", "edgekv/format/trt_rules.py",
      'if o.domain in ("", "ai.onnx"):', 'if o.domain in ("", "ai.onnx") or True:', TRT),
    M("check-trt: custom-domain nodes", "check-trt", "edgekv/format/trt_rules.py",
      'if n.domain not in ("", "ai.onnx"):', "if False:", TRT),
    M("check-trt: ops missing from the table", "check-trt", "edgekv/format/trt_rules.py",
      "if op in unsup or op not in sup or op in not_yet:", "if op in unsup or op in not_yet:", TRT),
    M("check-trt: ops newer than the version", "check-trt", "edgekv/format/trt_rules.py",
      "if op in unsup or op not in sup or op in not_yet:", "if op in unsup or op not in sup:", TRT),
    M("check-trt: build-time constant inputs", "check-trt", "edgekv/format/trt_rules.py",
      "if k < len(n.input) and n.input[k] and n.input[k] not in constants:", "if False:", TRT),
    M("check-trt: Cast from a quantized type", "check-trt", "edgekv/format/trt_rules.py",
      "if TYPES.get(to) in _QUANTIZED or src in _QUANTIZED:", "if TYPES.get(to) in _QUANTIZED:", TRT),
    M("check-trt: Cast to a quantized type", "check-trt", "edgekv/format/trt_rules.py",
      "if TYPES.get(to) in _QUANTIZED or src in _QUANTIZED:", "if src in _QUANTIZED:", TRT),
    M("check-trt: Cast source types", "check-trt", "edgekv/format/trt_rules.py",
      'elif src and src not in rule["types"]:', "elif False:", TRT),
    M("check-trt: Q/DQ scales constant", "check-trt", "edgekv/format/trt_rules.py",
      'if ver["qdq_scale_must_be_constant"] and scale not in constants:', "if False:", TRT),
    M("check-trt: zero points constant", "check-trt", "edgekv/format/trt_rules.py",
      "if zp and zp not in constants:", "if False:", TRT),
    M("check-trt: DequantizeLinear input types", "check-trt", "edgekv/format/trt_rules.py",
      'if op == "DequantizeLinear" and src and src not in _QUANTIZED:', "if False:", TRT),
    M("check-trt: QuantizeLinear input types", "check-trt", "edgekv/format/trt_rules.py",
      'if op == "QuantizeLinear" and src and src not in ("FP32", "FP16", "BF16"):', "if False:", TRT),
    M("check-trt: UINT8 inside the network", "check-trt", "edgekv/format/trt_rules.py",
      'if t == "UINT8" and tname not in graph_io and tname not in constants:', "if False:", TRT),
    M("check-trt: an empty .onnx passes", "check-trt", "edgekv/format/trt_graph.py",
      "if not model.graph.node or not model.opset_import:", "if False:", TRT_CLI),
    # -- chat (a held sequence of the engine: its cells, ids and sinks change only through the
    # engine, so the bugs of a separate id list are bugs of those methods)
    M("chat: one stale slot kept after /undo", "chat", "edgekv/chat/session.py",
      "        self._keep_common_prefix(self.conv.render(self.conv.msgs(), self.seq.ids))\n        return True",
      "        held = self.seq.ids\n"
      "        self.batcher.truncate(self.seq, min(len(held), common_prefix(held, self.conv.render(self.conv.msgs(), held)) + 1))\n"
      "        return True", CHAT),
    M('held: truncate keeps one stale id', 'chat', 'edgekv/runtime/batching/kv.py',
      'seq._set(cells[:n], seq.ids[:n])', 'seq._set(cells[:n], seq.ids[:n + 1])', ('tests/test_chat_invariants.py', 'tests/test_chat.py', '-m', 'not slow')),
    M('chat: the ring runs one position past the verified context', 'chat', 'edgekv/runtime/batching/poolseq.py',
      'return min(cells, self.max_positions - self.pos)', 'return min(cells, self.max_positions + 1 - self.pos)', ('tests/test_chat_invariants.py', 'tests/test_chat.py', '-m', 'not slow')),
    M("stream: a prompt one token past its room fed", "chat", "edgekv/runtime/batching/stream.py",
      "        if len(ids) > self.seq.room():", "        if len(ids) > self.seq.room() + 1:",
      ("tests/test_runtime.py", "-k", "exactly_its_room")),
    M("chat: drop-turns drops one message", "chat", "edgekv/chat/conversation.py",
      "self.messages = self.messages[2:] if len(self.messages) >= 2 else []",
      "self.messages = self.messages[1:]", CHAT),
    M("chat: one sink slot too many", "chat", "edgekv/chat/policies.py",
      "        seq.enable_ring(sinks)\n", "        seq.enable_ring(sinks + 1)\n", CHAT),
    M("chat: sinks not capped at half the cache", "chat", "edgekv/chat/policies.py",
      "        if sinks > seq.capacity // 2:\n", "        if sinks > seq.capacity - 2:\n",
      ("tests/test_hardening.py",) + CHAT),
    M('chat: a rolled-back turn keeps the cells it took', 'chat', 'edgekv/runtime/batching/turns.py',
      '        self.pool.set_state(turn.pool)\n', '', ('tests/test_chat_invariants.py', 'tests/test_chat.py', '-m', 'not slow')),
    M('chat: a rolled-back turn leaves the cells it overwrote', 'chat', 'edgekv/runtime/batching/turns.py',
      '        for start, rows in turn.rows:', '        for start, rows in []:', ('tests/test_hardening.py',)),
    M("chat: load drops the wrapped ring's first ids", 'chat', 'edgekv/runtime/batching/kv.py',
      '        seq._set(cells, ids)\n', '        seq._set(cells, ids[len(ids) - n:])\n', ('tests/test_chat_invariants.py', 'tests/test_chat.py', '-m', 'not slow')),
    M('held: a ring overwrites its sinks', 'chat', 'edgekv/runtime/batching/poolseq.py',
      '        sinks = self._sinks\n', '        sinks = 0\n', ('tests/test_chat_invariants.py', 'tests/test_chat.py', '-m', 'not slow')),
    M('chat: the last token of a turn is not fed', 'chat', 'edgekv/runtime/batching/postprocess.py',
      '        elif ask.feed_last and req.seq.can_feed():', '        elif False:', ('tests/test_bench.py', '-k', 'chat_turn')),
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
      "if span > bundle.max_context:", "if span > bundle.max_context + 1:", GUARDS),
    M("prompt as long as the cache accepted", "guards", "edgekv/tools/generate.py",
      "if len(ids) >= batcher.cache.capacity:", "if len(ids) > batcher.cache.capacity:", GUARDS),
    M("cache room one too many", "guards", "edgekv/runtime/batching/poolseq.py",
      "        cells = NO_LIMIT if self.ring else self.capacity - self.n", "        cells = NO_LIMIT if self.ring else self.capacity + 1 - self.n",
      ("tests/test_runtime.py", "-k", "exactly_its_room")),
    # -- bench / stats
    M("decode tok/s counts the first token", "bench", "edgekv/runtime/stats.py",
      "return self.decode_steps / self.decode_s", "return self.new_tokens / self.decode_s", BENCH),
    M("decode tok/s from shown tokens - 1 (a stop token's step not counted)", "bench", "edgekv/runtime/stats.py",
      "return self.decode_steps / self.decode_s", "return (self.new_tokens - 1) / self.decode_s", BENCH),
    M("bench decode rate counts one token more", "bench", "edgekv/tools/bench.py",
      "return t1 - t0, decode_tokens / (t2 - t1)", "return t1 - t0, (decode_tokens + 1) / (t2 - t1)", BENCH),
    M("bench comparison ratio against the wrong bundle's runs", "bench", "edgekv/tools/bench.py",
      'for x, t in zip(rs, theirs)])', 'for x, t in zip(per[0], theirs)])',
      ("tests/test_bench_llama_cpp.py", "-k", "several_bundles")),
    # -- serving engine (issue 13)
    M('a finished reply is not cached', 'serve', 'edgekv/runtime/batching/scheduler.py',
      'keep = reason in ("stop", "length") and req.seq.n > len(req.ask.prompt)', 'keep = False', ('tests/test_serve_engine.py', '-k', 'not real')),
    M('a cancelled reply is cached too', 'serve', 'edgekv/runtime/batching/scheduler.py',
      'keep = reason in ("stop", "length") and req.seq.n > len(req.ask.prompt)', 'keep = reason in ("stop", "length", "cancelled") and req.seq.n > len(req.ask.prompt)', ('tests/test_serve_engine.py', '-k', 'not real')),
    M('no compaction', 'serve', 'edgekv/runtime/batching/kv.py',
      '        if self.bucket(reach) > self.bucket(int(pool.live().sum()) + want) or length < min(want, pool.free()):', '        if False:', ('tests/test_serve_engine.py', '-k', 'not real')),
    M('no compaction for a fragmented step', 'serve', 'edgekv/runtime/batching/kv.py',
      ' or length < min(want, pool.free()):', ':', ('tests/test_serve_engine.py', '-k', 'not real')),
    M('cached cells bound as the past', 'serve', 'edgekv/runtime/batching/kv.py',
      'return self.bucket(self.pool.live_high_water())', 'return self.bucket(int(np.flatnonzero(np.r_[1, self.pool.refs])[-1]))', ('tests/test_serve_engine.py', '-k', 'not real')),
    M('compaction moves no K/V rows', 'serve', 'edgekv/runtime/batching/kv.py',
      '            self.cache.move_cells(moved, perm[moved])', '            pass', ('tests/test_serve_engine.py', '-k', 'not real')),
    M("compaction reads a cell after it was overwritten", "serve", "edgekv/runtime/memory.py",
      "        buf[dst] = buf[src]", "        for a, b in zip(src, dst): buf[b] = buf[a]", SERVE_ENGINE),
    M("compaction only where the step's cells land beyond the sequences'", 'serve', 'edgekv/runtime/batching/kv.py',
      'reach = max(pool.live_high_water(), start + length)', 'reach = pool.live_high_water()', ('tests/test_serve_engine.py', '-k', 'not real')),
    M("compaction leaves the prefix cache's cells unrenamed", "serve", "edgekv/runtime/pool.py",
      "            self.prefixes[key] = perm[cells]", "            pass", SERVE_ENGINE),
    M("compaction leaves a running request's cells unrenamed", 'serve', 'edgekv/runtime/batching/poolseq.py',
      'self._cells = perm[self._cells].tolist() if self._cells else []', 'self._cells = self._cells', ('tests/test_serve_engine.py', '-k', 'not real')),
    M("a half-done past binding taken for done", "perf", "edgekv/runtime/backends/binding.py",
      '        self._bound.pop("past", None)  # a Ctrl-C half-way through leaves some bound, some not: rebind all next time\n',
      "", ("tests/test_decode_step.py",)),
    M("the binding keeps a finished stream's cache alive", "perf", "edgekv/runtime/backends/binding.py",
      '        self._bound["past"] = (weakref.ref(cache),)\n', '        self._bound["past"] = (weakref.ref(cache), cache)\n',
      ("tests/test_runtime.py",)),
    M("the past binding keeps a finished stream's cache alive", "perf", "edgekv/runtime/backends/binding.py",
      '        self._bound["past"] = (weakref.ref(cache), past, local_past)\n',
      '        self._bound["past"] = ((lambda c=cache: c), past, local_past)\n', ("tests/test_runtime.py",)),
    M("the staging arrays keep a finished stream's cache alive", "perf", "edgekv/runtime/backends/binding.py",
      "            self._stage = (weakref.ref(cache), arrays, copies)\n",
      "            self._stage = ((lambda c=cache: c), arrays, copies)\n", ("tests/test_runtime.py",)),
    # -- the ort backend's Cast for the cache reads (issue 11)
    M("cache reads cast to the wrong type", "perf", "edgekv/graph/passes/cache_reads.py",
      "to = consts[node.input[1]].data_type", "to = onnx.TensorProto.FLOAT16", CAST_READS),
    M("a non-unit DQ read rewritten as Cast", "perf", "edgekv/graph/passes/cache_reads.py",
      "and len(node.input) >= 2 and is_scalar(node.input[1], 1.0)", "and len(node.input) >= 2", CAST_READS),
    M("a DQ read with a zero point rewritten as Cast", "perf", "edgekv/graph/passes/cache_reads.py",
      "or is_scalar(node.input[2], 0.0))", "or True)", CAST_READS),
    # -- issue 22: hardening (engine, HTTP layer, service lifecycle, chat, export/eval/bench, exact attention)
    M("a temperature too small for float32 divides the logits", "sampling", "edgekv/runtime/sampling.py",
      "if not p.temperature >= GREEDY_BELOW:", "if p.temperature <= 0:", SAMPLING),
    M("one request's sampling error fails the whole step", 'serve', 'edgekv/runtime/batching/postprocess.py',
      '                self._fail(req, e)', '                raise', ('tests/test_engine_hardening.py',)),
    M('fault: non-finite rows do not count', 'serve', 'edgekv/runtime/batching/postprocess.py',
      '        elif error is not None or self.bad:', '        elif error is not None:', ('tests/test_engine_hardening.py',)),
    M('fault: a step with only non-finite rows resets it', 'serve', 'edgekv/runtime/batching/postprocess.py',
      '        if error is None and self.good:', '        if error is None:', ('tests/test_engine_hardening.py',)),
    M('admission reserves the whole max_tokens again', 'serve', 'edgekv/runtime/batching/scheduler.py',
      '        return len(req.feed) - reused + min(HEADROOM, self._total(req) - len(req.feed))', '        return self._total(req) - reused', ('tests/test_engine_hardening.py',)),
    M('preemption takes the oldest request', 'serve', 'edgekv/runtime/batching/scheduler.py',
      '            victim = max((r for r in self.running if not r.kept), key=lambda r: r.order)', '            victim = min((r for r in self.running if not r.kept), key=lambda r: r.order)', ('tests/test_engine_hardening.py',)),
    M('a preempted request resumes without its reply', 'serve', 'edgekv/runtime/batching/request.py',
      '        self.feed = list(self.ask.prompt) + self.out', '        self.feed = list(self.ask.prompt)', ('tests/test_engine_hardening.py',)),
    M('a preempted request keeps its cells', 'serve', 'edgekv/runtime/batching/scheduler.py',
      '        self.kv.release(req.seq)\n        req.took_back()', '        req.took_back()', ('tests/test_engine_hardening.py',)),
    M("a prefix is reused across tenants", "serve", "edgekv/runtime/pool.py",
      "            if n <= best or key.tenant != tenant:", "            if n <= best:", ENGINE_HARD),
    M('queue 0 refuses what could start', 'serve', 'edgekv/runtime/batching/scheduler.py',
      '            if self._queued_behind() >= self.max_queue and self._would_wait(req):', '            if self._queued_behind() >= self.max_queue:', ('tests/test_engine_hardening.py',)),
    M("submit rewrites the caller's max_tokens", 'serve', 'edgekv/runtime/batching/scheduler.py',
      '            max_new = max(1, min(req.ask.max_tokens, self.kv.limit - len(prompt)))', '            max_new = max(1, min(req.ask.max_tokens, self.kv.limit - len(prompt))); object.__setattr__(req.ask, "max_tokens", max_new)', ('tests/test_engine_hardening.py',)),
    M('making room drops the prefix a preempted request resumes from', 'serve', 'edgekv/runtime/batching/scheduler.py',
      '            if self.kv.evict_freeing():', '            if self.kv.evict_one():', ('tests/test_engine_hardening.py',)),
    # the HTTP layer
    M("serve: Content-Length past the body limit read anyway", "serve", "edgekv/serve/front.py",
      'if length.isdigit() and int(length) > max_body_bytes:', 'if False:', HTTP_H + ("-k", "body_limit")),
    M("serve: chunked body not counted", "serve", "edgekv/serve/front.py",
      'if size > max_body_bytes:', 'if False:', HTTP_H + ("-k", "body_limit")),
    M("serve: request prepared on the event loop", "serve", "edgekv/serve/app.py",
      'ask = await asyncio.to_thread(prepare, raw)', 'ask = prepare(raw)', HTTP_H + ("-k", "health_answers_while")),
    M("serve: tokenizer holds the GIL", "serve", "edgekv/serve/fields.py",
      'return codec.tok.encode_batch([text], add_special_tokens=False)[0].ids',
      'return codec.tok.encode(text, add_special_tokens=False).ids', HTTP_H + ("-k", "lets_the_event_loop")),
    M("serve: no Host check on a local bind", "serve", "edgekv/serve/front.py",
      'if self.server.check_host and host is not None and host not in LOCAL_NAMES:', 'if False:',
      HTTP_H + ("-k", "local_bind")),
    M("serve: non-JSON POST bodies taken", "serve", "edgekv/serve/front.py",
      'if media != "application/json" or charset not in ("utf-8", "utf8"):', 'if False:', HTTP_H + ("-k", "must_be_json")),
    M("serve: hung-up non-streaming client not cancelled", "serve", "edgekv/serve/reply.py",
      'self.queue.put_nowait(GONE)', 'pass', HTTP_H + ("-k", "hang_up")),
    M("serve: only the first API key works", "serve", "edgekv/serve/front.py",
      'found = [t for k, t in keys if hmac.compare_digest(auth, b"Bearer " + k) or hmac.compare_digest(xkey, k)]',
      'found = [t for k, t in keys[:1] if hmac.compare_digest(auth, b"Bearer " + k) or hmac.compare_digest(xkey, k)]',
      HTTP_H + ("-k", "several_api_keys")),
    M("serve: every key one tenant", "serve", "edgekv/serve/front.py",
      'return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]', 'return ""',
      HTTP_H + ("-k", "cached_tokens_come_only or several_api_keys")),
    M("serve: negative seed passed to numpy", "serve", "edgekv/serve/fields.py",
      'return None if seed is None else seed & ((1 << 64) - 1)', 'return seed', HTTP_H + ("-k", "negative_seeds")),
    M("serve: huge int / deep nesting not a 400", "serve", "edgekv/serve/fields.py",
      'except (ValueError, RecursionError) as e:', 'except json.JSONDecodeError as e:', HTTP_H + ("-k", "bad_input")),
    M("serve: lone surrogate not refused", "serve", "edgekv/serve/fields.py",
      's.encode("utf-8")', 'pass', HTTP_H + ("-k", "bad_input or bad_completion")),
    M("serve: unsupported fields ignored", "serve", "edgekv/serve/fields.py",
      'if not harmless(body.get(name)):', 'if False:', HTTP_H + ("-k", "unsupported")),
    M("serve: /health ok while the engine faults", "serve", "edgekv/serve/app.py",
      'status = "ok" if self.state == "ready" and reason is None else ("error" if reason else self.state)',
      'status = "ok" if self.state == "ready" else self.state', HTTP_H + ("-k", "health")),
    M("serve: draining still generates", "serve", "edgekv/serve/app.py",
      'if self.state != "ready":', 'if self.state == "loading":', HTTP_H + ("-k", "health_states")),
    M("serve: 429 without Retry-After", "serve", "edgekv/serve/app.py",
      'headers={"Retry-After": str(RETRY_AFTER_S)}) from None', 'headers=None) from None', HTTP_H + ("-k", "429")),
    M("serve: 405 without Allow", "serve", "edgekv/serve/app.py",
      'headers=getattr(exc, "headers", None)).response(', 'headers=None).response(', HTTP_H + ("-k", "405")),
    M('serve: huge text tokenized before refusing', 'serve', 'edgekv/serve/app.py',
      'self.check_length(sum(len(m.get("content") or "") for m in c.messages), c.param)', 'pass', ('tests/test_serve_hardening.py', '-k', 'far_longer')),
    M("serve: a long stop holds back its length", "serve", "edgekv/serve/stops.py",
      'keep = 0 if final else _held_back(self.pending, self.stops)',
      'keep = 0 if final else max([0] + [len(s) - 1 for s in self.stops])', HTTP_H + ("-k", "long_stop or stop_text_property")),
    M("serve: stop chosen by start, not first completed", "serve", "edgekv/serve/stops.py",
      'found = [(i + len(s), i) for s in self.stops if (i := self.pending.find(s)) >= 0]',
      'found = [(i, i) for s in self.stops if (i := self.pending.find(s)) >= 0]', HTTP_H + ("-k", "stop_text_property")),
    M("serve: developer role not rendered as system", "serve", "edgekv/serve/tools.py",
      '"developer": "system"', '"developer": "developer"', HTTP_H + ("-k", "developer")),
    M("serve: no access log line", "serve", "edgekv/serve/front.py",
      'log.info("%s %s %s prompt=%s completion=%s %.3fs", scope["method"], scope["path"][:200],',
      'log.debug("%s %s %s prompt=%s completion=%s %.3fs", scope["method"], scope["path"][:200],', HTTP_H + ("-k", "access_log")),
    M("serve: unexpected error a plain-text 500", "serve", "edgekv/serve/app.py",
      'except Exception:\n                log.exception', 'except ZeroDivisionError:\n                log.exception',
      HTTP_H + ("-k", "json_500")),
    M("serve: stream null refused", "serve", "edgekv/serve/fields.py",
      'if v is not None and not isinstance(v, bool):', 'if not isinstance(v, bool):', HTTP_H + ("-k", "nulls")),
    # the service: start-up, warm-up, drain, slow clients, the unit installer
    M("serve: a busy port is a generic error", "serve", "edgekv/serve/listen.py", "if e.errno == errno.EADDRINUSE:", "if e.errno == -1:",
      LIFE + ("-k", "busy_port")),
    M("serve: ready without the warm-up", "serve", SERVER, "warm_up(batcher, rt.codec, signals.check)", "None", LIFE + ("-k", "loading_until")),
    M("serve: the warm-up in the clients' tenant", "serve", SERVER, "tenant=WARM_UP_TENANT", 'tenant=""',
      LIFE + ("-k", "loading_until")),
    M("serve: the gate answers 200 while loading", "serve", "edgekv/serve/listen.py",
      'await send({"type": "http.response.start", "status": 503,', 'await send({"type": "http.response.start", "status": 200,',
      LIFE + ("-k", "loading_until")),
    M("serve: systemd not told it is ready", "serve", SERVER, 'notify("READY=1\\nSTATUS=ready")', 'notify("STATUS=ready")',
      LIFE + ("-k", "loading_until")),
    M("serve: the drain does not wait", "serve", SERVER,
      "while busy(batcher, http) and time.monotonic() < deadline:", "while False:", LIFE + ("-k", "sigterm_drains")),
    M("serve: draining still says ready", "serve", SERVER, 'server.set_state("draining")', 'server.set_state("ready")',
      LIFE + ("-k", "sigterm_drains")),
    M("serve: a second signal ignored", "serve", "edgekv/serve/signals.py", "self.urgent = True  # from now on (draining)",
      "pass  # from now on (draining)", LIFE + ("-k", "second_signal")),
    M("serve: the grace period cuts nothing", "serve", SERVER, "        cut_the_rest(server, http, seconds, check)", "        pass",
      LIFE + ("-k", "grace_period")),
    M("serve: a stop while loading is a failure", "serve", SERVER,
      "return 128 + s.signum if signals.first is not None else 0", "return 128 + s.signum", LIFE + ("-k", "while_loading")),
    M("serve: no access log", "serve", SERVER, "log.setLevel(logging.WARNING if quiet else logging.INFO)",
      "log.setLevel(logging.WARNING)", LIFE + ("-k", "sigterm_drains")),
    M("serve: no read deadline", "serve", "edgekv/serve/listen.py", "self._deadline = self.loop.call_later(read_timeout, self._too_slow)",
      "self._deadline = None", LIFE + ("-k", "sends_nothing")),
    M("serve: the read deadline stops at the first byte", "serve", "edgekv/serve/listen.py", "if self.conn.their_state not in owed:", "if True:",
      LIFE + ("-k", "byte_at_a_time")),
    M("serve: no read deadline after a reply", "serve", "edgekv/serve/listen.py", "self._arm()  # the next request's time starts now",
      "pass  # the next request's time starts now", LIFE + ("-k", "kept_connection")),
    M("serve: the read deadline cuts replies", "serve", "edgekv/serve/listen.py",
      "            if self.conn.their_state not in owed:\n                self._disarm()",
      "            if self.conn.their_state not in owed:\n                pass", LIFE + ("-k", "long_reply")),
    M("install-service: replaces a foreign file", "jetson", INSTALL, '[ "$(head -n 1 "$1")" = "$MARK" ] || fail',
      'true || fail', LIFE + ("-k", "did_not_write")),
    M("install-service: writes through a symlink", "jetson", INSTALL, 'if [ -L "$1" ]; then fail', 'if false; then fail',
      LIFE + ("-k", "symlink")),
    M("install-service: stop timeout ignores the drain", "jetson", INSTALL, "STOP_SECONDS=$(( ${DRAIN%%.*} + 15 ))",
      "STOP_SECONDS=15", LIFE + ("-k", "writes_the_unit")),
    # chat: /save, /load, Ctrl-C, the weights record, /stats, templates
    M("chat: /save replaces a file that is not a saved chat", "chat", "edgekv/chat/persistence.py",
      "    if not is_ours(path):\n", "    if False:\n", CHAT_H + ("-k", "save_refuses or piped_chat_keeps")),
    M("chat: /save replaces another conversation's saved chat", "chat", "edgekv/chat/persistence.py",
      "    if theirs != conversation:", "    if False:", CHAT_H + ("-k", "save_refuses")),
    M("chat: /load does not take the file's conversation", "chat", "edgekv/chat/session.py",
      'conversation = saved.meta.get("conversation") or self.conversation_id', "conversation = self.conversation_id",
      CHAT_H + ("-k", "save_refuses")),
    M("chat: Ctrl-C in /save ends the chat", "chat", "edgekv/chat/terminal.py",
      "    except KeyboardInterrupt:\n        if file_identity(path) == before:",
      "    except EdgeKVError:\n        if file_identity(path) == before:", CHAT_H + ("-k", "every_line_of_save")),
    M("chat: a /load cut by Ctrl-C is not rolled back", "chat", "edgekv/chat/session.py",
      "            self.batcher.rollback()  # a rollback cut short",
      "            pass  # a rollback cut short", ("tests/test_chat_engine.py", "-k", "load_whose_rollback")),
    M("chat: a load ignores the weights that made the KV", "chat", "edgekv/chat/persistence.py",
      '    if (saved["weights"], saved["group"]) != (here["weights"], here["group"]):', "    if False:",
      CHAT_H + ("-k", "other_weights or each_thing")),
    M("chat: a load ignores the graph's sha256", "chat", "edgekv/chat/persistence.py",
      "        if a.get(name) != b.get(name):", "        if False:", CHAT_H + ("-k", "each_thing")),
    M("chat: a file without the weights record loads", "chat", "edgekv/chat/persistence.py",
      '    if "kv_origin" not in meta and not trust_unrecorded:', "    if False:", CHAT_H + ("-k", "before_the_weights_record")),
    M("chat: /stats repeats the last turn's line", "chat", "edgekv/chat/terminal.py",
      "            print(stats_report(s), file=err)", "            print(session_stats(s), file=err)",
      ("tests/test_chat_stats.py",)),
    M("chat: a rolled-back turn counted in /stats' totals", "chat", "edgekv/chat/session.py",
      "self.last_prompt_ids, self.turns) = before  # one statement: whole",
      "self.last_prompt_ids, _) = before  # one statement: whole",
      ("tests/test_chat_engine.py", "-k", "interrupt_at_every")),
    M("chat: /stats' decode median over one-token turns", "chat", "edgekv/chat/terminal.py",
      "rates = [st.decode_tps for st in stats if st.decode_s > 0]", "rates = [st.decode_tps for st in stats]",
      ("tests/test_chat_stats.py",)),
    M("chat: a stopped turn zeroes /stats", "chat", "edgekv/chat/session.py",
      '            st.stop_reason = "interrupted"  # self.last stays the last completed turn\'s',
      '            st.stop_reason = "interrupted"; self.last = st', CHAT_H + ("-k", "stats_after")),
    M("chat: a foreign /load names an exception class", "chat", "edgekv/chat/persistence.py",
      '    return "not a saved edgekv chat"\n', '    return "not a saved edgekv chat (ValueError)"\n',
      CHAT_H + ("-k", "not_a_saved_chat_is_one")),
    M("template: * is folded at compile time", "chat", "edgekv/runtime/text.py",
      'intercepted_binops = frozenset(["*", "**", "%", "+"])', 'intercepted_binops = frozenset(["**", "%", "+"])',
      CHAT_H + ("-k", "set and folded")),
    M("template: ~ joins without sizing its parts", "chat", "edgekv/runtime/text.py",
      "_check_size(sum(_size(p) for p in parts))", "pass", CHAT_H + ("-k", "concat and doubling")),
    M("template: str padding widths unchecked", "chat", "edgekv/runtime/text.py",
      "    if name in _PADDING and any(", "    if False and any(", CHAT_H + ("-k", "str and method")),
    M("template: filter widths and counts unchecked", "chat", "edgekv/runtime/text.py",
      "        if any(isinstance(v, int) and v > MAX_RENDER_CHARS for v in rest + tuple(kwargs.values())):",
      "        if False:", CHAT_H + ("-k", "center and filter or tojson")),
    M("template: + of strings unchecked", "chat", "edgekv/runtime/text.py",
      "                _check_size(len(left) + len(right))\n", "", CHAT_H + ("-k", "doubling and not concat")),
    # export, eval, bench
    M("re-export deletes every regular file, not only the old manifest's", "export", "edgekv/format/files.py",
      '            if name in owned and kind_of(entry) == "a file":', '            if kind_of(entry) == "a file":',
      EXPORT_H + ("-k", "replace_keeping")),
    M("re-export replaces the old bundle whole", "export", "export/destination.py",
      '    owned = bundle_files(out_dir)', '    owned = None', EXPORT_H + ("-k", "reexport")),
    M("a manifest may name files outside its folder", "export", "export/destination.py",
      'and n not in ("", ".", "..") and Path(n).name == n}', 'and n not in ("", ".", "..")}', EXPORT_H + ("-k", "outside_its_folder")),
    # a full disk, and the leftovers of killed writes (issue 41 item 3)
    M("disk: a temporary being written is swept as a leftover", "disk", "edgekv/format/files.py",
      '            return ""  # a writer holds it: in progress', '            pass  # a writer holds it: in progress',
      DISK + ("-k", "being_written")),
    M("disk: a leftover-named folder is emptied whatever it holds", "disk", "edgekv/format/files.py",
      "        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():", "        if False:",
      DISK + ("-k", "nothing_else_is")),
    M("disk: a disk-full error behind a library's cleanup error is a traceback", "disk", "edgekv/format/files.py",
      "        e = e.__cause__ or e.__context__", "        e = e.__cause__", DISK + ("-k", "cleanup")),
    M("disk: export checks the free space only after the long steps", "disk", "export/pipeline.py",
      "    check_room(dest.out_dir, least_bytes(src, opts.dtype, dest.weights))", "    pass",
      DISK + ("-k", "fails_before_the_long_steps")),
    M("--out checked only after the source is read", "export", "export/pipeline.py",
      '        check_out_dir(Path(out), force)', '        pass', EXPORT_H + ("-k", "out_refused")),
    M("--out under a file not refused before loading", "export", "export/destination.py",
      '    if not above.is_dir():', '    if False:', EXPORT_H + ("-k", "out_refused")),
    M("weights auto never int8", "export", "export/weights.py",
      '    return "int4" if 4 in bits else "int8"', '    return "int4"', EXPORT_H + ("-k", "auto_keeps")),
    M("weights auto ignores blocks it cannot keep", "export", "export/weights.py",
      '    if not bits or None in bits:', '    if not bits:', EXPORT_H + ("-k", "auto_keeps")),
    M("export --weights defaults to float", "export", "edgekv/cli/parsers.py",
      '    p.add_argument("--weights", default="auto",', '    p.add_argument("--weights", default="float",',
      EXPORT_H + ("-k", "defaults_to_auto")),
    M("progress stages never beat", "export", "edgekv/tools/progress.py",
      '        while not done.wait(every):', '        while False:', EXPORT_H + ("-k", "heartbeat")),
    M("export's weight KLD said to be against float weights", "export", "export/quantize.py",
      '    against = weight_reference(src, requantize)', '    against = "float weights"', EXPORT_H + ("-k", "auto_export")),
    M("eval weights MiB from the graph file", "eval", "edgekv/tools/evaluate.py",
      '    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else b.graph_bytes()',
      '    return b.graph_bytes()', ("tests/test_eval.py", "-k", "labels")),
    M("eval float KV row 'saving -100 %'", "eval", "edgekv/tools/evaluate.py",
      '    return f"no saving vs fp16 ({vs_fp16:.2f}x its bytes)"', '    return f"saving vs fp16 {100 * (1 - vs_fp16):.1f} %"',
      ("tests/test_eval.py", "-k", "labels")),
    M("eval plot axis names a fixed reference", "eval", "edgekv/tools/evaluate.py",
      '            f"mean KLD vs {ref} (log)",', '            "mean KLD vs float weights + float KV (log)",',
      ("tests/test_eval.py", "-k", "labels")),
    M("eval silent about a lone bundle being its own reference", "eval", "edgekv/tools/evaluate.py",
      '    if n_bundles == 1:', '    if False:', ("tests/test_eval.py", "-k", "labels")),
    M("eval --llama-cpp without the child probe", "eval", "edgekv/tools/evaluate.py",
      '            check_llama_cpp_runs(llama_cpp, ctx, threads, m["vocab_size"])', '            pass',
      ("tests/test_eval_llama_cpp.py",)),
    M("bench SIGILL of llama.cpp not recognised", "bench", "edgekv/tools/bench.py",
      '    if p.returncode == -signal.SIGILL:', '    if p.returncode == signal.SIGILL:', ("tests/test_bench_llama_cpp.py", "-k", "sigill")),
    M("bench prints no round lines", "bench", "edgekv/tools/bench.py",
      '            round_done(r)', '            pass', ("tests/test_bench.py", "-k", "reports_all")),
    # the CLI
    M("text arguments not checked for UTF-8", "guards", "edgekv/cli/__init__.py",
      "    if bad := undecodable(args):", "    if bad := None:", ("tests/test_cli_errors.py", "-k", "utf8")),
    M("the default model without the repeat guard", "guards", "models/smollm2-135m-instruct.json",
      '"repeat_penalty": 1.1,', '"repeat_penalty": 1.0,', ("tests/test_cli_errors.py", "-k", "defaults")),
    M("an older bundle without generate's repeat guard", "sampling", "edgekv/runtime/sampling.py",
      "UNRECORDED = dict(temperature=0.0, top_p=1.0, top_k=0, repeat_penalty=1.1)",
      "UNRECORDED = dict(temperature=0.0, top_p=1.0, top_k=0, repeat_penalty=1.0)", SAMPLING_DEFAULTS),
    M("a flag does not win over the manifest", "sampling", "edgekv/runtime/sampling.py",
      "values = {**base, **flags}", "values = {**flags, **base}", SAMPLING_DEFAULTS),
    M("generate ignores the model's defaults", "sampling", "edgekv/tools/generate.py",
      "params = sampling_from(args, rt.bundle.manifest)", "params = sampling_from(args)", SAMPLING_DEFAULTS),
    M("chat ignores the model's defaults", "sampling", "edgekv/chat/terminal.py",
      "params = sampling_from(args, rt.bundle.manifest)", "params = sampling_from(args)", SAMPLING_DEFAULTS),
    M("the recipe's sampling loses to the source's", "sampling", "export/model_sampling.py",
      "    if given is None:\n        return dict(source_sampling)", "    if True:\n        return dict(source_sampling)",
      SAMPLING_DEFAULTS),
    M("generation_config's do_sample false sampled", "sampling", "export/model_sampling.py",
      'if gen.get("do_sample") is False:', 'if False:', SAMPLING_DEFAULTS),
    M("a GGUF's float32 sampling kept unrounded", "sampling", "export/model_sampling.py",
      "return float(str(np.float32(value)))", "return float(value)", SAMPLING_DEFAULTS),
    M("a manifest's out-of-range sampling taken", "sampling", "edgekv/runtime/sampling.py",
      "if not (lo < v if lo_open else lo <= v) or not v <= hi:", "if False:", SAMPLING_DEFAULTS),
    # exact attention (temperature 0 a function of the prompt)
    M("exact softmax left as written", "perf", "edgekv/graph/passes/exact_sums.py",
      "                replace[n.output[0]] = self._softmax(n)", "                pass", INT4_EXACT),
    M("exact values at the wrong scale", "perf", "edgekv/graph/passes/exact_sums.py",
      'self._node("Mul", [p + "total", p + "back"], out)]', 'self._node("Mul", [p + "total", p + "unit"], out)]', INT4_EXACT),
    M("exact attention off by default", "perf", "edgekv/runtime/backends/ort.py",
      'return os.environ.get(EXACT_ENV, "1")', 'return os.environ.get(EXACT_ENV, "0")', INT4_EXACT),
    # issue 24, phase 1: the fused graph
    M("fused: RoPE rotated interleaved", "fused", "edgekv/graph/passes/fused_attention.py",
      "rotary_interleaved=0)", "rotary_interleaved=1)", FUSED + ("-k", "float_kv")),
    M("fused: seqlens_k one too many", "fused", "edgekv/runtime/backends/fused.py",
      "SEQLENS: np.array([at + s - 1], np.int32)", "SEQLENS: np.array([at + s], np.int32)", FUSED + ("-k", "float_kv")),
    M("fused: key cache scaled by the value scale", "fused", "edgekv/graph/passes/fused_attention.py",
      "g.g.initializer.extend([nh.from_array(L.k_scale.astype(np.float32)",
      "g.g.initializer.extend([nh.from_array(L.v_scale.astype(np.float32)", FUSED + ("-k", "static_int8")),
    M("fused: any DxD matrix taken for rotate_half", "fused", "edgekv/graph/passes/fused_match.py",
      "return n if 0 < n <= d and np.array_equal(r, rotate_half_matrix(d, n)) else None", "return n if 0 < n <= d else None",
      FUSED + ("-k", "unknown_rope")),
    M("fused: a float16 manifest on a float32 graph", "fused", "edgekv/graph/passes/fused_match.py",
      "    if g.const(w).dtype != np.dtype(dtype):", "    if False:", FUSED + ("-k", "float16")),
    # issue 24: the fused graph in the runtime
    M("fused: a call written inside the past not moved", "fused", "edgekv/runtime/backends/fused.py", "        if at != write:", "        if False:", FUSED + ("-k", "run_cells")),
    M("fused: a first prompt's positions assumed to run on", "fused", "edgekv/runtime/backends/fused.py", "direct = write == past and (past > 0 or runs_on)", "direct = write == past", FUSED + ("-k", "run_cells")),
    M("fused: the key mask ignored on append", "fused", "edgekv/runtime/backends/fused.py", "    bias = np.full((1, 1, s, at + s), -np.inf, np.float32)\n", "    if at == past:\n        return np.zeros((1, 1, s, at + s), np.float32)\n    bias = np.full((1, 1, s, at + s), -np.inf, np.float32)\n", FUSED + ("-k", "run_cells")),
    M("fused: a wrapped ring's overwritten slots seen", "fused", "edgekv/runtime/backends/fused.py", "BIAS: attention_bias(key_mask, past, at, s)}", "BIAS: attention_bias(np.ones_like(key_mask), past, at, s)}", FUSED + ("-k", "ring")),
    # issue 24 item 4: the fused graph on ort-cuda (its code on the CPU provider, host OrtValues)
    M("ort-cuda fused: the cache in host memory (copied to the GPU and back every call)", "fused",
      "edgekv/runtime/backends/ort_cuda.py",
      "        return OrtValueHeadMajorMemory(self.ort, self.device, 0 if self.single_stream else FUSED_SPARE)",
      "        return HeadMajorMemory(0 if self.single_stream else FUSED_SPARE)", FUSED_CUDA + ("-k", "equals_the_plain_graph")),
    M("ort-cuda fused: a call hiding past cells run without its mask", "fused", "edgekv/runtime/backends/ort_cuda.py",
      "return bool(key_mask[0, :, :past].all()) and np.array_equal(", "return True or np.array_equal(",
      FUSED_CUDA + ("-k", "one_line")),
    M("ort-cuda fused: a moved call's device copy strided without the spare slots", "fused",
      "edgekv/runtime/backends/gpu.py", "base + src * row, slots * row, n * row, heads)",
      "base + src * row, (slots - self.spare) * row, n * row, heads)", FUSED_CUDA + ("-k", "moved_calls")),
    M("ort-cuda fused slots: a block's address without the heads", "fused", "edgekv/runtime/backends/gpu.py",
      "return buf.data_ptr() + first * heads * length * dim", "return buf.data_ptr() + first * length * dim",
      FUSED_CUDA + ("-k", "serve_slots")),
    M("head-major moves on the wrong axis", "fused", "edgekv/runtime/memory.py", "        buf[0, :, dst] = buf[0, :, src]", "        buf[0, dst] = buf[0, src]", FUSED + ("-k", "head_major")),
    M("auto never fuses", "fused", "edgekv/runtime/backends/fused.py", 'elif mode == "auto" and bundle.scheme.kind != "static":', 'elif mode == "auto":', FUSED + ("-k", "no_plain_attention")),
    M("fused on an onnxruntime below 1.27", "fused", "edgekv/runtime/backends/fused.py", "            why = ort_refusal(backend.ort.__version__)", "            why = None", FUSED + ("-k", "older_onnxruntime")),
    M("a cache of the other layout accepted", "fused", "edgekv/runtime/backends/ort.py", ' or cache.layout != getattr(self.memory, "layout", "slots"):', ":", FUSED + ("-k", "refuses_a_head")),
    M("fused calls beyond the spare slots", "fused", "edgekv/runtime/backends/fused.py", "    max_tokens_per_call = FUSED_SPARE", "    max_tokens_per_call = 1 << 30", FUSED + ("-k", "spare_slots")),
    M("ort-cuda fuses a float32 graph", "fused", "edgekv/runtime/backends/ort_cuda.py", '        if bundle.dtype == "float32":', "        if False:", ("tests/test_backends.py", "-k", "ort_cuda_runs")),
    M("bench: llama.cpp once, not per round", "bench", "edgekv/tools/bench.py", "if gguf is not None and failed is None and (args.attention or r == rounds - 1):", "if gguf is not None and failed is None and r == rounds - 1:", ("tests/test_bench_llama_cpp.py", "-k", "attentions_take_turns")),
    M("bench: ratios of round 1, not the median", "bench", "edgekv/tools/bench.py", 'rows.append({**row, **{f: statistics.median(x[f] for x in same) for f in row if f != "prompt_tokens"}})', "rows.append(row)", ("tests/test_bench_llama_cpp.py", "-k", "median_ratios")),
    # issue 26: structured output (grammar, logprobs, tools)
    M("post-processing: no stop at a complete grammar", "structured", "edgekv/runtime/batching/postprocess.py", "            elif c is not None and c.is_done():", "            elif c is None and c.is_done():", ("tests/test_grammar.py", "-k", "whole_reply")),
    M("grammar: bitmask unpacked big-endian", "structured", "edgekv/runtime/grammar_constraint.py", 'bitorder="little", count=self.tok.vocab_size', 'bitorder="big", count=self.tok.vocab_size', ("tests/test_grammar.py", "-k", "bitmask")),
    M("grammar: one stop id only", "structured", "edgekv/runtime/grammar_tokenizer.py", "eos_token=list(stop_ids))", "eos_token=list(stop_ids)[-1:])", ("tests/test_grammar.py", "-k", "bitmask")),
    M("grammar: lenient schemas", "structured", "edgekv/runtime/grammar_build.py", 'JSON_OVERRIDES = {"lenient": False,', 'JSON_OVERRIDES = {"lenient": True,', ("tests/test_grammar.py", "-k", "unsupported or lenient")),
    M("grammar: warnings accepted", "structured", "edgekv/runtime/grammar_constraint.py", "    warnings = m.get_grammar_warnings()", "    warnings = []", ("tests/test_grammar.py", "-k", "unsupported or lenient")),
    M("generate: grammar file not checked regular", "structured", "edgekv/runtime/grammar_cli.py", "    if not stat.S_ISREG(os.fstat(fd).st_mode):", "    if stat.S_ISDIR(os.fstat(fd).st_mode):", ("tests/test_grammar.py", "-k", "errors_are_one_line")),
    M("logprobs without temperature", "sampling", "edgekv/runtime/sampling.py", "x = (x - top) / (p.temperature if p.temperature >= GREEDY_BELOW else 1.0)", "x = x - top", ("tests/test_sampling.py", "-k", "logprob")),
    M("logprobs without the penalty", "sampling", "edgekv/runtime/sampling.py", "x = penalized(logits, p, history).astype(np.float64)", "x = logits.astype(np.float64)", ("tests/test_sampling.py", "-k", "logprob")),
    M("top logprobs ties not by id", "sampling", "edgekv/runtime/sampling.py", "tied[: n - above.shape[0]]", "tied[above.shape[0] - n:]", ("tests/test_sampling.py", "-k", "logprob")),
    M("top logprobs list forbidden tokens", "sampling", "edgekv/runtime/sampling.py", "n = min(top_n, int(np.isfinite(lp).sum()))", "n = min(top_n, lp.shape[0])", ("tests/test_sampling.py", "-k", "logprob")),
    M("tools: parallel calls always", "structured", "edgekv/serve/tool_grammar.py", "more = MAX_PARALLEL_CALLS - 1 if plan.parallel else 0", "more = MAX_PARALLEL_CALLS - 1", ("tests/test_tools.py", "-k", "required_named")),
    M("tools: auto not lazy", "structured", "edgekv/serve/tool_grammar.py", 'f"head[lazy]: TEXT {op}"', 'f"head: TEXT {op}"', ("tests/test_tools.py", "-k", "auto or forced")),
    M("tools: marker prefix not held back", "structured", "edgekv/serve/tool_stream.py", "end = len(self.buf[: end - _held(self.buf, OPEN)].rstrip())", "end = len(self.buf[:end].rstrip())", ("tests/test_tools.py", "-k", "reassembly")),
    M("tools: tool_calls finish on length", "structured", "edgekv/serve/tool_stream.py", 'return "tool_calls" if engine_reason == "stop" and msg.get("tool_calls") else engine_reason', 'return "tool_calls" if msg.get("tool_calls") else engine_reason', ("tests/test_tools.py", "-k", "parse_reply")),
    M("tools: a tool result answers no call", "structured", "edgekv/serve/tools.py", "            if cid not in called:", "            if cid is None:", ("tests/test_tools.py", "-k", "messages_checked")),
    M("response_format json_object unconstrained", "structured", "edgekv/serve/structured.py", "        return json_object()", "        return None", ("tests/test_structured.py", "-k", "json_object")),
    # issue 41 item 1 and issue 43 item 4: a grammar's cost bounded per request; tool calls end with their list
    M("grammar: nested repetitions not measured", "structured", "edgekv/runtime/grammar_build.py", "    if spelled > MAX_REGEX_SPELLED:", "    if False:", ("tests/test_grammar_limits.py", "-k", "storms_patterns")),
    M("grammar: a mask past its budget goes on", "structured", "edgekv/runtime/grammar_constraint.py", "            if cpu > self.mask_budget_s:", "            if False:", ("tests/test_grammar_limits.py", "-k", "mask")),
    M("grammar: a failed mask computed again", "structured", "edgekv/runtime/grammar_constraint.py", "        if self._error is not None:", "        if False:", ("tests/test_grammar_limits.py", "-k", "says_so_once")),
    M("grammar: a build past its budget accepted", "structured", "edgekv/runtime/grammar_constraint.py", "        if used > budget_s:", "        if False:", ("tests/test_grammar_limits.py", "-k", "cpu_budget")),
    M("grammar: built on the calling thread", "structured", "edgekv/runtime/grammar_worker.py", "    return _watched(pool().submit(compile_grammar, tok, grammar).result())", "    return _watched(compile_grammar(tok, grammar))", ("tests/test_grammar_limits.py", "-k", "workers")),
    M("grammar: a schema's x-guidance unbounds whitespace", "structured", "edgekv/runtime/grammar_build.py", '"x-guidance": {**own, **JSON_OVERRIDES}', '"x-guidance": {**JSON_OVERRIDES, **own}', ("tests/test_grammar_limits.py", "-k", "x_guidance")),
    M("tools: the call list unbounded", "structured", "edgekv/serve/tool_grammar.py", "call){{0,{more}}}'", "call)*'", ("tests/test_tool_calls_end.py", "-k", "list_is_bounded")),
    M("tools: a repeated call does not end the reply", "structured", "edgekv/serve/tool_constraint.py", "        return self._stream.repeats > 0 or self.inner.is_done()", "        return self.inner.is_done()", ("tests/test_tool_calls_end.py", "-k", "repeated")),
    M("tools: a repeated call shown", "structured", "edgekv/serve/tool_stream.py", "        if self._waiting is not None and self._call in self.seen:", "        if False:", ("tests/test_tool_calls_end.py", "-k", "dropped")),
    M("tools: invented argument keys allowed", "structured", "edgekv/serve/tool_grammar.py", '            s["additionalProperties"] = False', "            pass", ("tests/test_tool_calls_end.py", "-k", "invented")),
    M("structured: a reply that cannot close is started", "structured", "edgekv/serve/tool_grammar.py", "    if least > max_tokens:", "    if False:", ("tests/test_tool_calls_end.py", "-k", "cannot_close")),
    M("eager attention: the key mask dropped", "export", "export/kv_torch.py",
      "v_all.permute(1, 2, 0, 3), attn_mask=mask)", "v_all.permute(1, 2, 0, 3))", ("tests/test_model_vs_hf.py",)),
    M("eager attention: the mask's rows in (position, head) order", "export", "export/kv_torch.py",
      "mask = allowed[:, None, None].expand(B, 1, G, GS // G, -1).reshape(B, 1, GS, -1)",
      "mask = allowed[:, None, :, None].expand(B, 1, GS // G, G, -1).reshape(B, 1, GS, -1)",
      ("tests/test_model_vs_hf.py",)),
    # issue 23: architectures
    M("NoPE layers rotated", "export", "export/model.py", "None if i in cfg.nope_layers", "None if i < 0", ARCH),
    M("qwen3 q/k norm skipped", "export", "export/model.py", "qk = self.norm_qk(qk)", "qk = qk", ARCH),
    M("partial rotary rotates all", "export", "export/model.py", "rotate_half_matrix(cfg.head_dim, cfg.rotary_dim)", "rotate_half_matrix(cfg.head_dim)", ARCH),
    M("longrope attention factor dropped", "export", "export/model.py", "cos, sin = cos * amp, sin * af", "cos, sin = cos, sin", ARCH),
    M("longrope never long", "export", "export/model_config.py", 'long = max_context > rs["original_max_position_embeddings"]', "long = False", ARCH),
    M("gguf rope_freqs ignored", "export", "export/gguf_loader.py", 'rope_freq_factors=vec("rope_freqs.weight") if "rope_freqs.weight" in tensors else None,', "rope_freq_factors=None,", ARCH),
    M("gguf smollm3 NoPE shifted", "export", "export/gguf_loader.py", "if (i + 1) % 4 == 0) if arch", "if (i + 1) % 4 == 1) if arch", ARCH),
    M("gguf smollm3 not unpermuted", "export", "export/gguf_loader.py", '"smollm3": True', '"smollm3": False', ARCH),
    M("gguf longrope attn factor ignored", "export", "export/gguf_loader.py", '"attention_factor": float(field(f"{arch}.rope.scaling.attn_factor", 1.0))', '"attention_factor": 1.0', ARCH),
    M("gemma norms without 1 +", "export", "export/checkpoint_names.py", 'offset = FAMILIES[cfg.arch].get("norm_offset", 0.0)', "offset = 0.0", ARCH),
    M("gemma post-attention norm skipped", "export", "export/model.py", "a = self.post_attn_norm(a)", "a = a", ARCH),
    M("gemma window one longer", "export", "export/model.py", "(d < self.cfg.sliding_window)", "(d <= self.cfg.sliding_window)", ARCH),
    M("gemma local rope base = global", "export", "export/model_config.py", "theta = cfg.rope_local_theta if local else cfg.rope_theta", "theta = cfg.rope_theta", ARCH),
    M("query_pre_attn_scalar ignored", "export", "export/model.py", "q = q * self.q_gain", "q = q", ARCH),
    M("gemma embeddings unscaled", "export", "export/model.py", "x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)", "x = x", ARCH),
    M("splitter holds nothing back", "chat", "edgekv/runtime/reasoning.py", "keep = _held(self.pending, self.close_tag)", "keep = 0", ("tests/test_reasoning.py",)),
    M("splitter keeps the answer's newlines", "chat", "edgekv/runtime/reasoning.py", 'self.pending = self.pending.lstrip("\\n")', "self.pending = self.pending", ("tests/test_reasoning.py",)),
    M("with_thinking ignored", "chat", "edgekv/runtime/text.py", "enable_thinking = self.enable_thinking", "enable_thinking = None", ARCH),
    M("chat --thinking hide prints it", "chat", "edgekv/chat/terminal.py", "if part.reasoning and self.show:", "if part.reasoning:", ("tests/test_reasoning.py",)),
    # issue 25: the batcher's units
    M("scheduler: teacher-forced rows start one token late", "engine", "edgekv/runtime/batching/scheduler.py", "scored = 0 if lf is None else max(0, end - max(r.fed, lf))", "scored = 0 if lf is None else max(0, end - max(r.fed, lf + 1))", ("tests/test_serve_engine.py", "-k", "teacher")),
    M("runner: a token does not see its first cell", "engine", "edgekv/runtime/batching/runner.py", "mask[0, r: r + n, cells] = True", "mask[0, r: r + n, cells[1:]] = True", ("tests/test_serve_engine.py", "-k", "teacher")),
    M("kv manager: a commit records a piece one cell off", "engine", "edgekv/runtime/batching/kv.py", "p.seq._extend(range(w, w + len(p.tokens)), p.tokens)", "p.seq._extend(range(w + 1, w + 1 + len(p.tokens)), p.tokens)", ("tests/test_serve_engine.py", "-k", "teacher")),
    M("turns: copied only if copied already", "engine", "edgekv/runtime/batching/turns.py", "todo = (turn.pool.refs[w: w + s] > 0) & ~turn.saved[w: w + s]", "todo = (turn.pool.refs[w: w + s] > 0) & turn.saved[w: w + s]", ("tests/test_chat_engine.py", "-k", "failed_turn")),
    M("post-processing: the constraint's mask not applied", "engine", "edgekv/runtime/batching/postprocess.py", "tok = sample(seen, ask.params, req.rng, history)", "tok = sample(row, ask.params, req.rng, history)", ("tests/test_serve_engine.py", "-k", "constraint_makes")),
    M("post-processing: logprobs of the unmasked row", "engine", "edgekv/runtime/batching/postprocess.py", "logprobs(seen, ask.params, history, tok, ask.logprobs)", "logprobs(row, ask.params, history, tok, ask.logprobs)", ("tests/test_serve_structured.py",)),
    # issue 26 in serve
    M("serve: the request's constraint dropped", "serve", "edgekv/serve/app.py", "tenant=request.state.tenant, constraint=ask.constraint, logprobs=ask.logprobs)", "tenant=request.state.tenant, constraint=None, logprobs=ask.logprobs)", ("tests/test_serve_structured.py",)),
    M("serve: a streamed call ends with stop", "serve", "edgekv/serve/reply.py", 'self.finish = "tool_calls" if ts is not None and finish == "stop" and ts.n_calls else finish', "self.finish = finish", ("tests/test_serve_structured.py",)),
    M("serve: include_usage lost", "serve", "edgekv/serve/chat.py", "            if self.api.include_usage:", "            if self.api.include_usage and False:", ("tests/test_serve_structured.py",)),
    M("serve: the built server without its bundle", "serve", "edgekv/serve/server.py", "bundle=rt.bundle, **server)", "**server)", ("tests/test_serve_structured.py", "-k", "edgekv_serve_builds")),
    # issue 23: GGUF K-quants kept exactly
    M("Q5_0 codes offset by 15", "weights", "export/gguf_blocks.py", "return q.astype(np.int8) - 16, _f16(raw, 0)[:, None], 32, None", "return q.astype(np.int8) - 15, _f16(raw, 0)[:, None], 32, None", KQ),
    M("K-quant high scale bits misplaced", "weights", "export/gguf_blocks.py", "sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)", "sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 3)], axis=1)", KQ),
    M("Q6_K high bits shifted wrong", "weights", "export/gguf_blocks.py", "high = ((qh >> np.array([0, 2, 4, 6], np.uint8)", "high = ((qh >> np.array([0, 2, 4, 4], np.uint8)", KQ),
    M("Q4_1/Q4_K shift forgotten", "weights", "export/weights.py", "codes, shift = codes - 8, 8", "codes, shift = codes - 8, 0", KQ),
    M("graph's shift term wrong", "weights", "export/weights_graph.py", 'np.array(float(q.shift), dtype), base + "_shift"', 'np.array(float(q.shift - 1), dtype), base + "_shift"', KQ + ("-k", "mixed")),
    M("fused Q4_0 beside Q4_1 keeps no -8s", "weights", "export/weights.py", "mins = mins - np.float32(shift - q.shift) * scales  # a power of two times s: exact", "mins = mins", KQ + ("-k", "fused")),
    M("auto refuses fused mixed records", "weights", "export/weights.py", 'parts = {name: {p for t in ts for p in t.split("|")} for name, ts in types.items()}', "parts = {name: set(ts) for name, ts in types.items()}", KQ + ("-k", "auto")),
    M("identical initializers stored twice", "weights", "export/graph_file.py", "        if key not in where:", "        if True:", ("tests/test_weights.py", "-k", "tied")),
    # issue 24: static INT8 calibrated by output error
    M("static search scores on its own statistics' windows", "calibration", "export/calibrate.py", "    folds = [(windows[0::2], windows[1::2]), (windows[1::2], windows[0::2])]", "    folds = [(windows[0::2], windows[0::2]), (windows[1::2], windows[1::2])]", CALIB),
    M("static headroom not applied to K", "calibration", "export/calibrate.py", 'a.k_scale.copy_(fit(c["k_headroom"] * k_all / 127.0))', 'a.k_scale.copy_(fit(k_all / 127.0))', CALIB),
    M("static V headroom picks the largest error", "calibration", "export/calibrate.py", "    av = min(errs_v, key=errs_v.get)", "    av = max(errs_v, key=errs_v.get)", CALIB),
    M("first token left out of V too", "calibration", "export/calibrate.py", "        _, v_all = channel_absmax(wins, 0)  # the first token's values always count (the search tries keys only)", '        _, v_all = channel_absmax(wins, 0 if c["k_counts_first_token"] else 1)', CALIB),
    # issue 23: Gemma 3's local layers through local_key_mask
    M("gemma runner mask ignores the window", "engine", "edgekv/runtime/batching/runner.py", "        return local & mask", "        return mask", GEMMA),
    M("gemma wrapped ring's cells at slot positions", "engine", "edgekv/runtime/batching/poolseq.py", "        out[self._sinks or 0:] += gone", "        pass", GEMMA),
    M("fused: Gemma's local layers read the global bias", "fused", "edgekv/graph/passes/fused_attention.py", '*rotary, bias[L.local], ""]', '*rotary, bias[False], ""]', ("tests/test_fused_gemma3.py",)),
    M("fused: the query gain's scale dropped", "fused", "edgekv/graph/passes/fused_attention.py", 'own = {} if L.scale is None else {"scale": L.scale}', 'own = {}', ("tests/test_fused_gemma3.py",)),
    M("fused: the local bias built from key_mask", "fused", "edgekv/runtime/backends/fused.py", "feeds[BIAS_LOCAL] = attention_bias(local_key_mask, past, at, s)", "feeds[BIAS_LOCAL] = attention_bias(key_mask, past, at, s)", ("tests/test_fused_gemma3.py",)),
    M("fused slots: the window one key too wide", "fused", "edgekv/runtime/backends/fused.py", "np.where(d < window,", "np.where(d <= window,", ("tests/test_fused_gemma3.py",)),
    M("fused: the load line names EDGEKV_ATTENTION where the caller chose", "fused", "edgekv/runtime/backends/fused.py", 'way_out = f"; {ATTENTION_ENV}=plain runs the graph as written" if asked is None else ""', 'way_out = f"; {ATTENTION_ENV}=plain runs the graph as written"', ("tests/test_fused_gemma3.py",)),
    M("trt local mask not fed", "trt", "edgekv/runtime/backends/trt.py", "            small.append((LOCAL_MASK, self.d_local, local_key_mask.shape))", "            pass", GEMMA),
    # issue 23: the windowed cache (the local layers keep W - 1 slots, a ring per stream)
    M("windowed: the ring one slot short", "engine", "edgekv/format/bundle.py", "    return max(1, window - 1)", "    return max(1, window - 2)", GEMMA_WINDOW),
    M("windowed: a long chunk keeps its first rows", "engine", "edgekv/runtime/batching/window_rings.py", "            rows.append(r + np.arange(first, len(p.tokens)))", "            rows.append(r + np.arange(0, len(p.tokens) - first))", GEMMA_WINDOW),
    M("windowed: a ring slot's position one off", "engine", "edgekv/runtime/batching/window_rings.py", "            slots.append(p.seq.window_ring * self.length + kept % self.length)", "            slots.append(p.seq.window_ring * self.length + (kept + 1) % self.length)", GEMMA_WINDOW),
    M("windowed: every decode step written to ring slot 0", "engine", "edgekv/runtime/backends/plain.py", "local_slot = int(ring[1][0]) if ring else write", "local_slot = write % ring[1].size if ring else write", GEMMA_WINDOW),
    M("windowed pool: a ring slot one past the window", "engine", "edgekv/runtime/batching/runner.py", "(held >= 0)[None] & (q - held[None] < window)", "(held >= 0)[None] & (q - held[None] <= window)", GEMMA_POOL),
    M("windowed pool: a rolled-back turn leaves the ring", "engine", "edgekv/runtime/batching/turns.py", "            self.cache.write_ring(ring, rows)", "            pass", GEMMA_POOL),
    M("windowed pool: truncation past the ring's window allowed", "engine", "edgekv/runtime/batching/window_rings.py", "        return bool(np.isin(need, seq.window_positions()).all())", "        return True", GEMMA_POOL),
    M("windowed pool: a piece's ring keeps one token fewer", "engine", "edgekv/runtime/batching/window_rings.py", "        first = max(0, len(p.tokens) - self.length)\n", "        first = max(0, len(p.tokens) - self.length + 1)\n", GEMMA_POOL),
    M("windowed pool: a ring's positions recorded reversed", "engine", "edgekv/runtime/batching/poolseq.py", "        self._window_pos[positions % len(self._window_pos)] = positions", "        self._window_pos[positions % len(self._window_pos)] = positions[::-1]", GEMMA_POOL),
    M("windowed: the ring's bytes counted per token", "engine", "edgekv/runtime/cache.py", "        self.bytes_per_token = (need - self.local_bytes) // capacity", "        self.bytes_per_token = need // capacity", GEMMA_WINDOW),
    # issue 23/24: a GGUF minimum folded into MatMulNBits' zero points at load
    M("nbits: remainder drops the zero point's share", "weights", "edgekv/graph/passes/minimum_fold.py", "r = m64 + s64 * zp", "r = m64 + s64 * 0", NBITS),
    M("nbits: zero point floored, remainder up to a step", "weights", "edgekv/graph/passes/minimum_fold.py", "np.clip(np.rint(-m64 / s64), lo, hi)", "np.clip(np.floor(-m64 / s64), lo, hi)", NBITS),
    M("nbits: non-float32 remainder not refused", "weights", "edgekv/graph/passes/minimum_fold.py", "if not np.array_equal(r32.astype(np.float64), r):", "if False:", NBITS),
    M("nbits: zero point not attached to the DQ", "weights", "edgekv/graph/passes/minimum_fold.py", 't.dq.input.append(base + "_zp")', 't.dq.input.append("")', NBITS),
    M("ort-cpu: minimums not folded at load", "weights", "edgekv/runtime/backends/ort.py", "    fold_minimums = True", "    fold_minimums = False", ("tests/test_weights.py", "-k", "minimums")),
    # issue 26: chat's schema, masks ahead, reasoning_content
    M("chat reuses the compiled matcher instead of a fresh one", "chat", "edgekv/chat/session.py", "return self.reply_grammar.fresh(), ", "return self.reply_grammar, ", ("tests/test_chat.py",)),
    M("masks never made ahead", "engine", "edgekv/runtime/batching/postprocess.py", "if not todo or not self.overlap_masks:", "if not todo or self.overlap_masks:", ("tests/test_grammar.py",)),
    M("serve never splits the think part", "serve", "edgekv/serve/app.py", "split_reasoning=self.thinks,", "split_reasoning=False,", ("tests/test_reasoning.py",)),
    M("enable_thinking not passed to the template", "serve", "edgekv/serve/app.py", 'codec = self.codec.with_thinking(c.thinking) if c.thinking is not None else self.codec', "codec = self.codec", ("tests/test_reasoning.py",)),
    # the Messages and Responses APIs (issue 43): translated into the chat API's request, rendered in their own shapes
    M("messages: the system prompt dropped", "serve", "edgekv/serve/messages.py", 'out.append({"role": "system", "content": _text_blocks(body["system"], "system")})', "pass", ("tests/test_api_messages.py", "-k", "greedy")),
    M("messages: no ping event", "serve", "edgekv/serve/messages.py", 'yield self.event("ping", {})', "pass", ("tests/test_api_messages.py", "-k", "event_sequence")),
    M("messages: a tool_result's content lost", "serve", "edgekv/serve/messages.py", 'results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": out})', 'results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": ""})', ("tests/test_api_messages.py", "-k", "tool_round_trip")),
    M("messages: a stop sequence reported as end_turn", "serve", "edgekv/serve/messages.py", 'return "stop_sequence" if reply.stop_sequence is not None else "end_turn"', 'return "end_turn"', ("tests/test_api_messages.py", "-k", "stop_sequences")),
    M("messages: cached prompt tokens counted twice", "serve", "edgekv/serve/messages.py", '"input_tokens": r.prompt_tokens - r.cached_tokens', '"input_tokens": r.prompt_tokens', ("tests/test_api_messages.py", "-k", "greedy")),
    M("messages: no thinking block", "serve", "edgekv/serve/messages.py", 'content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})', "pass", ("tests/test_api_messages.py", "-k", "thinking")),
    M("messages: errors in OpenAI's shape", "serve", "edgekv/serve/api.py", "        if api is Api.MESSAGES:\n            status", "        if False:\n            status", ("tests/test_api_messages.py", "-k", "anthropic_shaped")),
    M("messages: x-api-key not read", "serve", "edgekv/serve/front.py", " or hmac.compare_digest(xkey, k)]", "]", ("tests/test_api_messages.py", "-k", "x_api_key")),
    M("messages: count_tokens off the prompt", "serve", "edgekv/serve/app.py", "return len(encode_unlocked(self.codec, self.render(ask, plan)))", "return len(encode_unlocked(self.codec, self.render(ask, plan))) + 1", ("tests/test_api_messages.py", "-k", "count_tokens")),
    M("responses: sequence numbers from 1", "serve", "edgekv/serve/responses.py", "'sequence_number': self.seq - 1", "'sequence_number': self.seq", ("tests/test_api_responses.py", "-k", "event_sequence")),
    M("responses: instructions dropped", "serve", "edgekv/serve/responses.py", """out.append({"role": "system", "content": _content(body["instructions"], "'instructions'", "instructions")})""", "pass", ("tests/test_api_responses.py", "-k", "greedy")),
    M("responses: a function_call_output's output lost", "serve", "edgekv/serve/responses.py", '"content": _content(it.get("output"), f"input[{i}].output")})', '"content": ""})', ("tests/test_api_responses.py", "-k", "function_call")),
    M("responses: a cut reply completed", "serve", "edgekv/serve/responses.py", 'return "incomplete" if self.reply.finish == "length" else "completed"', 'return "completed"', ("tests/test_api_responses.py", "-k", "incomplete")),
    M("responses: previous_response_id ignored", "serve", "edgekv/serve/responses.py", 'for name in ("previous_response_id", "conversation"):', 'for name in ("conversation",):', ("tests/test_api_responses.py", "-k", "stateless")),
    M("include_usage: the usage in every chunk", "serve", "edgekv/serve/chat.py", 'return self.event({"choices": [choice]})', 'return self.event({"choices": [choice], "usage": self.usage()})', ("tests/test_serve_http.py", "-k", "openai_client")),
    M("unknown chat_template_kwargs not refused", "serve", "edgekv/serve/fields.py", "unknown = sorted(k for k in kw if k not in TEMPLATE_KWARGS)", "unknown = []", ("tests/test_reasoning.py",)),
    M("bench-serve counts no masks", "serve", "edgekv/serve/bench.py", "made.append(c)", "pass", ("tests/test_serve_bench.py",)),
    # issue 24 item 5: every architecture through the fused path; item 4's float16 graph side
    M("fused: q/k norm skipped", "fused", "edgekv/graph/passes/fused_match.py", "    if qk == vsplit.output[0]:", "    if qk is not None:", FUSED_ARCHS + ("-k", "float_kv")),
    M("fused: tables' sin negated", "fused", "edgekv/graph/passes/fused_match.py", 'return "op", qk, (cos, sin, c[:, :h], s[:, :h])', 'return "op", qk, (cos, sin, c[:, :h], -s[:, :h])', FUSED_ARCHS + ("-k", "float_kv")),
    M("fused: partial rotary's tables from the wrong half", "fused", "edgekv/graph/passes/fused_match.py", 'return "op", qk, (cos, sin, c[:, :h], s[:, :h])', 'return "op", qk, (cos, sin, c[:, h:], s[:, h:])', FUSED_ARCHS + ("-k", "float_kv and d32")),
    M("fused: rotary alignment of r ignored", "fused", "edgekv/graph/passes/fused_match.py", "if D % GQA_ROTARY_ALIGN or r % GQA_ROTARY_ALIGN:", "if D % GQA_ROTARY_ALIGN:", FUSED_ARCHS + ("-k", "float_kv")),
    M("fused: batch read off the BNSH cache", "fused", "edgekv/graph/passes/fused_attention.py", "    _batch_from_positions(g)\n", "    pass\n", FUSED_ARCHS + ("-k", "float_kv")),
    M("fused: q|k|v packed slot-major", "fused", "edgekv/graph/passes/fused_attention.py", "perm=[1, 0, 2, 3])", "perm=[0, 1, 2, 3])", FUSED_ARCHS + ("-k", "float_kv")),
    M("fused: float16 bias not cast", "fused", "edgekv/graph/passes/fused_attention.py", '    if dtype == "float32":', "    if True:", FUSED_ARCHS + ("-k", "float16")),
    M("fused: float16 tables written float32", "fused", "edgekv/graph/passes/fused_attention.py", "np.ascontiguousarray(t, dtype), n)", "np.ascontiguousarray(t, np.float32), n)", FUSED_ARCHS + ("-k", "float16")),
    M("fused: float16 norm's cast not looked through", "fused", "edgekv/graph/passes/fused_match.py", "return _through_cast(g, x), w, float(eps)", "return x, w, float(eps)", FUSED_ARCHS + ("-k", "float16")),
    # issue 24 item 3: serve on fused slots
    M("fused slots: a free slot's prefix not used in place", "serve", "edgekv/runtime/batching/slots.py", "        if source in free:", "        if False:", FUSED_SERVE),
    M("fused slots: a finished request's tokens not kept as its slot's prefix", "serve", "edgekv/runtime/batching/slots.py", "            self.entry[k] = keep", "            pass", FUSED_SERVE),
    M("fused slots: the decode call placed at slot 0", "serve", "edgekv/runtime/batching/slots.py", "            yield SlotCall.of(first, entries)", "            yield SlotCall.of(0, entries)", FUSED_SERVE),
    M("fused slots: seqlens_k one past the tokens", "serve", "edgekv/runtime/backends/fused.py", "        seqlens = np.maximum(lengths + query - 1, 0).astype(np.int32)", "        seqlens = np.maximum(lengths + query, 0).astype(np.int32)", FUSED_SERVE),
    M("fused slots: a request's limit is the whole cache, not its slot", "serve", "edgekv/runtime/batching/slots.py", "        self.limit = min(length, cache.max_positions)", "        self.limit = min(cache.capacity, cache.max_positions)", FUSED_SERVE),
    M("slot memory: a cell's position taken modulo the slots", "serve", "edgekv/runtime/memory.py", "        return cells // buf.shape[2], cells % buf.shape[2]", "        return cells // buf.shape[2], cells % buf.shape[0]", FUSED_SERVE),
    M("serve --slots: no minimum slot size", "serve", "edgekv/serve/server.py", "    if per < MIN_SLOT:", "    if per < 1:", FUSED_SERVE),
    M("fused graph without query_seqlens", "fused", "edgekv/runtime/backends/fused.py", "        with_query_lengths(index.model)", "        pass", FUSED_SERVE),
    M("bench-serve: an SSE error event counted as success", "serve", "edgekv/serve/bench.py", '                if error is not None:', "                if False:", ("tests/test_serve_bench_slots.py", "-k", "sse_error")),
    M("bench-serve: serve's layout not followed", "serve", "edgekv/serve/bench.py", "slots=layout)", "slots=0)", ("tests/test_serve_bench_slots.py", "-k", "fused_slots")),
    M("eval: another model's tokenizer accepted", "eval", "edgekv/tools/evaluate.py", "(json.dumps(b.model, sort_keys=True), _tokenizer_sha(b))", "(json.dumps(b.model, sort_keys=True),)", ("tests/test_eval_sources.py",)),
    M("eval: another file of one model refused", "eval", "edgekv/tools/evaluate.py", "    if len({(json.dumps(b.model", "    if len({(b.manifest.get('source', {}).get('sha256'), json.dumps(b.model", ("tests/test_eval_sources.py",)),
    # the remainder's blocksum as one shared MatMul
    M("nbits: blocksum indicator in the wrong column", "weights", "edgekv/graph/passes/minimum_fold.py", "e[np.arange(k), np.arange(k) // block] = 1.0", "e[np.arange(k), np.arange(k) % (k // block)] = 1.0", NBITS),
    M("nbits: the fold skipped as if no graph had block-wise weights", "weights", "edgekv/graph/passes/minimum_fold.py", '    if not any(n.op_type == "DequantizeLinear" and g.attr(n, "block_size", 0) for n in g.g.node):', "    if True:", ("tests/test_weights.py", "tests/test_gguf_kquants.py", "-k", "fold or minimum")),
    M("nbits: blocksum MatMuls placed before the graph's first node", "weights", "edgekv/graph/passes/minimum_fold.py", "            nodes.insert(at, self.pending[x])", "            nodes.insert(0, self.pending[x])", NBITS),
    # export speed: sympy's cache, the QDQ pass's shape inference without the weights' bytes
    M("weights' bytes given to shape inference", "export", "export/onnx_export.py", "init.ByteSize() > WEIGHT_BYTES:", "init.ByteSize() > 1 << 40:", ("tests/test_qdq_inference.py",)),
    M("sympy cache left at its default", "export", "export/__init__.py", 'os.environ["SYMPY_CACHE_SIZE"] = "None"', 'os.environ["SYMPY_CACHE_SIZE"] = "1000"', ("tests/test_sympy_cache.py",)),
    M("SYMPY_CACHE_SIZE leaked into the environment", "export", "export/__init__.py", 'del os.environ["SYMPY_CACHE_SIZE"]', "pass", ("tests/test_sympy_cache.py",)),
    # the turn's rollback, caught by the Ctrl-C tests at conftest's interrupt_points
    M("turns: a rollback leaves the overwritten rows", "engine", "edgekv/runtime/batching/turns.py", "        for start, rows in turn.rows:", "        for start, rows in turn.rows[:0]:", ("tests/test_chat_engine.py", "-k", "interrupt_at_every")),
    M("turns: a cell copied again after its first write", "engine", "edgekv/runtime/batching/turns.py", "        turn.saved[w: w + s] |= todo", "        pass", ("tests/test_chat_engine.py", "-k", "interrupt_at_every")),
    M("turns: kept sequences not restored", "engine", "edgekv/runtime/batching/turns.py", "            seq._restore_state(state)", "            pass", ("tests/test_chat_engine.py", "-k", "interrupt_at_every")),
    M("request: cancel() marks nothing", "engine", "edgekv/runtime/batching/request.py", "        self.cancelled = True\n", "        pass\n", ("tests/test_serve_engine.py", "-k", "cancel")),
    M("batcher: a rollback keeps the waiting requests", "engine", "edgekv/runtime/batching/scheduler.py", "            self.waiting.clear()", "            pass", ("tests/test_chat_engine.py", "-k", "interrupt_at_every")),
    M("serve: a Stop swallowed while loading is not raised again", "serve", "edgekv/serve/signals.py", "            self.defer = True\n        self.check()", "            self.defer = True", ("tests/test_serve_signals.py", "-k", "swallowed")),
    M("serve: an error a swallowed Stop left is reported as the error", "serve", "edgekv/serve/signals.py", "            if self.pending is None:\n                raise", "            raise", ("tests/test_serve_signals.py", "-k", "left_behind")),
    M("fp16 scales counted as float32", "export", "export/weights.py", "side = 2 if self.half_scales else 4", "side = 4", FP16),
    M("half-scale widen takes a shared fp16 source", "format", "edgekv/graph/passes/trt_staging.py", "and readers[n.input[0]] == 1 and n.input[0] not in ix.outputs", "and n.input[0] not in ix.outputs", FP16),
    M("half-scale widen takes any Cast", "format", "edgekv/graph/passes/trt_staging.py", '            and any(a.name == "to" and a.i == TensorProto.FLOAT for a in n.attribute))', "            )", FP16),
    M("half-scale widen keeps fp16", "format", "edgekv/graph/passes/trt_staging.py", '.astype("float32"), c.output[0])', ", c.output[0])", FP16),
    M("check-trt stages without widening", "format", "edgekv/format/trt_rules.py", "        stage_weights(model, path.parent)  # as the engine build's staging: fp16 scales widened, packed codes unpacked\n", "", TRT_W),
    M("Cast-fed scale rule misses fp16", "format", "edgekv/format/trt_rules.py", 'f.types.get(prod.input[0]) == "FP16"', 'f.types.get(prod.input[0]) == "FP32"', TRT_W),
    M("K-quant scales stored fp16", "export", "export/gguf_blocks.py", 'HALF_SCALES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"})', 'HALF_SCALES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})', KQ),
    M("Q8_0 scales float32", "export", "export/gguf_blocks.py", 'HALF_SCALES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"})', 'HALF_SCALES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1"})', FP16),
    M("nbits: an fp16 scale's Cast not taken for a constant", "weights", "edgekv/graph/index.py", "        return cone(name, self.producer, self.inits) is not None", "        return name in self.inits", FP16 + ("-k", "tokens_unchanged")),
    M("packed codes: the high bits' places reversed", "format", "edgekv/format/weight_forms.py", "hi |= (high[j::per] << (h * j)).astype(np.uint8)", "hi |= (high[j::per] << (h * (per - 1 - j))).astype(np.uint8)", FORMS),
    M("packed codes: the offset not applied", "format", "edgekv/format/weight_forms.py", "q = (codes.astype(np.int16) + offset).astype(np.uint8)", "q = codes.astype(np.int16).astype(np.uint8)", FORMS),
    M("factored scales: d laid out untransposed", "export", "export/weights_graph.py", "d, sc, shape = f.d.T.reshape(supers, 1, n)", "d, sc, shape = f.d.reshape(supers, 1, n)", FORMS),
    M("packed codes counted at 8 bits", "export", "export/weights.py", "codes = self.codes.size * self.width[0] // 8", "codes = self.codes.size * self.bits // 8", KQ + ("-k", "stored_as")),
    M("engine build: packed codes not unpacked", "trt", "edgekv/graph/passes/trt_staging.py", "return widen_half_scales(model, folder) + fold_forms(model, folder)", "return widen_half_scales(model, folder)", KQ + ("-k", "tensorrt_rules")),
    M("runtime: packed codes left to onnxruntime's folding", "weights", "edgekv/graph/passes/weight_forms.py", "form_values(index.g, index.base_dir, least=2)", "form_values(index.g, index.base_dir, least=99)", KQ + ("-k", "handed")),
    M("memory: head-major ring writes along the wrong axis", "engine", "edgekv/runtime/memory.py", "buf[0, :, slots] = arr[:, 0]  #", "buf[0, :, slots] = arr[:, 0].transpose(1, 0, 2)  #", ("tests/test_backends.py", "-k", "scatter")),
    M("fused: the forms' value_info dropped", "weights", "edgekv/graph/passes/fused_attention.py", "forms = [v for v in g.g.value_info if v.name in need and g.is_const(v.name)]", "forms = []", FP16 + ("-k", "tokens_unchanged")),
    M("engine build: fp16 scales not widened", "trt", "jetson/build_engine.py", "    staged = stage_weights(model, path.parent)", "    staged = []", ("tests/test_weights.py", "-k", "engine_build")),
    M("write_cells: the snapshot's rows in reverse order", "runtime", "edgekv/runtime/cache.py", "self.memory.write_slots(self.buffers[name], cells, snap[name])", "self.memory.write_slots(self.buffers[name], cells, snap[name][::-1])", ("tests/test_backends.py", "-k", "write_cells")),
    M("device memories' write_slots: each run's rows reversed", "runtime", "edgekv/runtime/memory.py", "        memory.write_rows(buf, a, arr[i: i + b - a])", "        memory.write_rows(buf, a, arr[i: i + b - a][::-1])", ("tests/test_backends.py", "-k", "scatter")),
    M("tensorrt_graph: not staged", "trt", "edgekv/runtime/backends/engines.py", "    stage_weights(model, folder)\n    return per_channel", "    return per_channel", W_TRT),
    M("nbits: every remainder dropped (the term's speed for +20 % PPL)", "weights", "edgekv/graph/passes/minimum_fold.py", "        if r.any():", "        if False:", NBITS),
    M("fused: later layers' key scale off", "fused", "edgekv/graph/passes/fused_attention.py", "nh.from_array(L.k_scale.astype(np.float32).reshape(1, Hkv, 1, D), ins[-2])", "nh.from_array(L.k_scale.astype(np.float32).reshape(1, Hkv, 1, D) * (1.01 if i else 1.0), ins[-2])", FUSED + ("-k", "static_int8")),
    M("backends: a signal during a native import not held", "serve", "edgekv/runtime/backends/__init__.py", "    if threading.current_thread() is threading.main_thread():", "    if False:", ("tests/test_serve_signals.py", "-k", "native_import")),
    M("stamp: every copy reads the traced layer's weights", "export", "export/stamp.py", "weights[new] = tensors[_model_key(new, tensors)]", "weights[new] = tensors[_model_key(name, tensors)]", STAMP),
    M("stamp: what reads the cache taken for layer-invariant", "export", "export/stamp.py", '{x_in[j], *io_of("past", j, True), *layer_inits[j]}', "{x_in[j], *layer_inits[j]}", STAMP),
    M("stamp: the head reads the last traced layer, not the last copy", "export", "export/stamp.py", "    latest[x_out[len(reps) - 1]] = x\n", "", STAMP),
    # serve's windowed pool (tests/test_serve_windowed.py)
    M("serve windowed: a cached prefix reused without its window", "engine", "edgekv/runtime/batching/kv.py", "            self.window_rings.put(seq, *self.windows.before(key, k))", "            pass", SERVE_WINDOWED),
    M("serve windowed: an evicted entry's window copy kept", "engine", "edgekv/runtime/batching/kv.py", "        if dropped and self.windows:\n", "        if False:\n", SERVE_WINDOWED),
    M("serve windowed: any match reused, its window covered or not", "engine", "edgekv/runtime/batching/prefix_windows.py", "        return w is not None and w.holds(max(0, k - self.cache.window + 1), k)", "        return w is not None", SERVE_WINDOWED),
    M("serve windowed: the copy's positions after the match kept", "engine", "edgekv/runtime/batching/prefix_windows.py", "        keep = w.positions < k\n", "        keep = w.positions >= 0\n", SERVE_WINDOWED),
    M("serve windowed: more sequences than rings admitted", "engine", "edgekv/runtime/batching/kv.py", "            self.max_sequences = cache.rings\n", "", SERVE_WINDOWED),
    M("serve windowed: window copies beyond what keeps the pool under the full one", "engine", "edgekv/runtime/assemble.py", "    copies = min(parallel, fit) if copies is None else copies", "    copies = parallel if copies is None else copies", SERVE_WINDOWED),
    M("serve windowed: a ring not given back with its request", "engine", "edgekv/runtime/batching/window_rings.py", "        self.free.append(seq.window_ring)", "        pass", SERVE_WINDOWED),
    M("turns: a rollback cut short closes the turn", "engine", "edgekv/runtime/batching/turns.py", "        turn = self.current\n        if turn is None:\n            return False\n", "        turn, self.current = self.current, None\n        if turn is None:\n            return False\n", ("tests/test_chat_engine.py", "-k", "rollback_cut_short")),
    M("turns: an interrupt at the commit leaves the turn open", "engine", "edgekv/runtime/batching/batcher.py", "            yield turn\n            turns.commit()  # the last line: nothing runs here once the turn is kept\n        except BaseException:\n            self.rollback()\n            raise\n", "            yield turn\n        except BaseException:\n            self.rollback()\n            raise\n        turns.commit()\n", ("tests/test_chat_engine.py", "-k", "bare_turn")),
    M("snapshot: an old file's wrapped ring loaded in slot order", "engine", "edgekv/runtime/batching/snapshot.py", "    order = np.r_[0: sinks, w: n, sinks: w]", "    order = np.r_[0: sinks, sinks: w, w: n]", ("tests/test_chat_engine.py", "-k", "old_format")),
    M("window rings: a full cache's snapshot fills the ring from its first cells", "engine", "edgekv/runtime/batching/window_rings.py", "            keep = np.flatnonzero(pos >= len(ids) - self.length)", "            keep = np.arange(min(self.length, n))", GEMMA_POOL),
    M("window rings: restored rows not in their slots' order", "engine", "edgekv/runtime/batching/window_rings.py", "seq.window_ring * self.length + slots[order], rows[name][order])", "seq.window_ring * self.length + slots[order], rows[name])", GEMMA_POOL),
    M("snapshot: a windowed ring part not checked before the restore", "engine", "edgekv/runtime/batching/batcher.py", "        self.kv.window_rings.to_restore(seq, cells, ring, ids, n)\n", "", GEMMA_POOL),
    M("snapshot: an old wrapped file into a session without a ring, no hint", "engine", "edgekv/runtime/batching/snapshot.py", "    seq.check_restore(n, ids)  # (first", "    pass  # (first", ("tests/test_chat_engine.py", "-k", "old_format")),
    M("turns: the caller's undo not called by the rollback", "engine", "edgekv/runtime/batching/turns.py", "            turn.undo()\n", "            pass\n", ("tests/test_chat_engine.py", "-k", "interrupt_at_every")),
    M("chat: an interrupted reply keeps the discarded turn's stats", "chat", "edgekv/chat/session.py", "self.rng.bit_generator.state, self.last,\n         self.last_prompt_ids, self.turns) = before", "self.rng.bit_generator.state, _,\n         _, self.turns) = before", ("tests/test_chat_engine.py", "-k", "interrupt_at_every")),
    # issue 25 item 2: a request's state decides what happens to it
    M("state: a closing request samples on", "engine", "edgekv/runtime/batching/postprocess.py", "        if req.state is CLOSING:  # its last token is in the cells now", "        if False:", CHAT),
    M("state: a closing request's last token not fed", "engine", "edgekv/runtime/batching/request.py", "DECODES = (DECODING, CLOSING)", "DECODES = (DECODING,)", CHAT),
    M("state: feed_last accepted without a kept sequence", "engine", "edgekv/runtime/batching/request.py", "        if feed_last and seq is None:", "        if False:", ENGINE_HARD),
    M("a step that plans nothing spins", "engine", "edgekv/runtime/batching/batcher.py", "        if not plan:  # requests run", "        if False:  # requests run", ENGINE_HARD),
    # the tests' trace cache
    M("trace cache: a hit keeps the stored graph's emptied tensors", "tests", "tests/trace_cache.py", "        init.const_value = ir.Tensor(np.ascontiguousarray(array), name=name)", "        pass", ("tests/test_trace_cache.py",)),
    M("trace cache: tied tensors left out of the key", "tests", "tests/trace_cache.py", '        h.update(f"{name} is {first.setdefault(id(t), name)}, shares memory with "', '        h.update(f"{name} is {name}, shares memory with "', ("tests/test_trace_cache.py",)),
    M("trace cache: a wrapped model's tensors not found", "tests", "tests/trace_cache.py", '    return own | {f"model.{k}": v for k, v in own.items()}', "    return own", ("tests/test_trace_cache.py",)),
    M("trace cache: a module's flags left out of the key", "tests", "tests/trace_cache.py", '                h.update(f"{k} {v!r}\\n".encode())', "                pass", ("tests/test_trace_cache.py",)),
    # issue 40: weight products' rows on every CPU (edgekv/runtime/backends/rows.py)
    M("rows: a one-row difference not padded", "runtime", "edgekv/runtime/backends/rows.py", "        elif single:\n            plan.padded.add(kind)", "        elif False:\n            plan.padded.add(kind)", ("tests/test_rows.py", "tests/test_avx2_emulated.py")),
    M("rows: many-row differences called exact", "runtime", "edgekv/runtime/backends/rows.py", "        if many:\n            plan.unequal.add(kind)", "        if False:\n            plan.unequal.add(kind)", ("tests/test_rows.py",)),
    M("rows: the padded row dropped from the front", "runtime", "edgekv/runtime/backends/rows.py", '("rows.pad", [0, 0, 1, 0])', '("rows.pad", [1, 0, 0, 0])', ("tests/test_rows.py",)),
    M("rows: the probe compares one-row calls with themselves", "runtime", "edgekv/runtime/backends/rows.py", "    single = any(not np.array_equal(run(x[i:i + 1]), whole[i:i + 1]) for i in range(len(x)))", "    single = False", ("tests/test_rows.py", "tests/test_avx2_emulated.py")),
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
