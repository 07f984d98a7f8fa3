"""`edgekv eval-context`: which context-full policy answers better in a long chat?

When a conversation outgrows the cache, chat can
  drop-turns  drop whole old exchanges, re-render and re-prefill what is kept (edgekv's chat), or
  ring        keep the first tokens (system prompt = attention sinks) and overwrite the oldest
              slots as a ring (StreamingLLM); nothing is prefilled again, positions keep growing.

Measured against the oracle of an unlimited cache: a conversation is generated once with the
whole history in a large cache (greedy; built-in questions, one per turn), then its assistant
replies are scored, teacher-forced, under each policy at --ctx: KL divergence from the
full-context distribution, top-1 agreement with it, and the replies' perplexity, over the turns
where the history no longer fits. Also the tokens each policy prefills per turn (its cost).
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np

from edgekv.chat.conversation import Conversation, common_prefix, sink_count
from edgekv.chat.policies import DropTurns
from edgekv.chat.session import ChatSession
from edgekv.errors import EdgeKVError, note
from edgekv.format.files import write_json
from edgekv.format.bundle import load_bundle
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.batching import Batcher, Request
from edgekv.runtime.batching.stream import Stream
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.text import TextCodec, system_turn
from edgekv.tools.evaluate import log_softmax

QUESTIONS = [
    "Hi! My name is Lena and I live in Porto. What is a good name for a cat?",
    "What is the capital of France?",
    "And of Germany?",
    "Explain in two sentences what photosynthesis is.",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "What does a CPU do?",
    "Suggest a simple dinner recipe with rice.",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Name three planets of the solar system.",
    "What is a prime number? Give an example.",
    "How do I boil an egg?",
    "What language is spoken in Brazil?",
    "Tell me a fun fact about octopuses.",
    "What is the boiling point of water in Celsius?",
    "Summarize what we talked about so far in one sentence.",
    "What is my name, and where do I live?",
    "Give me a word that rhymes with 'light'.",
    "What is the largest ocean on Earth?",
    "How can I learn to play the guitar?",
    "Thank you! Any last advice for today?",
]


def span_of(codec: TextCodec, ids: list[int], before: list[dict], reply: str) -> tuple[int, int]:
    """Where the reply's tokens sit in `ids` (the render of before + the reply)."""
    start = len(codec.chat_ids(before, add_generation_prompt=True))
    r = codec.encode(reply)
    if ids[start: start + len(r)] != r:
        raise EdgeKVError("the chat template does not render appended turns as appended tokens; cannot score")
    return start, start + len(r)


def score(stream: Stream, ids: list[int], spans: list[tuple[int, int]]) -> list[np.ndarray]:
    """Feed ids through stream in one pass, teacher-forced; return the log-probs of the rows that
    predict each span's tokens."""
    out, pos = [], 0
    for s, e in spans:
        lp = stream.prefill(ids[pos: e - 1], all_logits=True, logits_from=s - 1 - pos)
        out.append(log_softmax(lp))
        pos = e - 1
    return out


def score_ring(batcher: Batcher, sinks: int, ids: list[int], spans: list[tuple[int, int]]) -> list[np.ndarray]:
    """`score` on the ring `edgekv chat` runs: a kept ring sequence of the batcher, each stretch one
    request appending to it. (A ring fed a reply as one prefill chunk gives up that many of its
    oldest tokens at once, a little earlier than decoding token by token would.)"""
    seq = batcher.hold()
    seq.enable_ring(sinks)
    out, pos = [], 0
    for s, e in spans:
        req = batcher.run(Request(ids[pos: e - 1], 0, seq=seq, logits_from=s - 1 - pos))
        out.append(log_softmax(np.stack(req.logits)))
        pos = e - 1
    return out


def evaluate_context(bundle_path: str, ctx: int = 512, turns: int = 24, reply_tokens: int = 96,
                     system: str | None = None, sinks: int | None = None, threads: int | None = None, out=sys.stdout) -> dict:
    bundle = load_bundle(bundle_path)
    # the reference holds the whole conversation: caches up to the bundle's verified context
    with open_runtime(bundle, bundle.max_context, "auto", threads, max_logits_rows=256, log=None) as rt:
        return compare_policies(rt, ctx, turns, reply_tokens, system, sinks, out)


def compare_policies(rt, ctx: int, turns: int, reply_tokens: int, system: str | None, sinks: int | None, out) -> dict:
    bundle, codec = rt.bundle, rt.codec
    say = lambda s: print(s, file=out, flush=True)  # noqa: E731
    questions = (QUESTIONS * (1 + turns // len(QUESTIONS)))[:turns]

    # 1. the reference conversation: greedy, the whole history in the cache
    big = bundle.max_context
    batcher = rt.batcher(big, parallel=1, max_queue=1, max_prefixes=0, windowed=True)  # what `edgekv chat` runs
    sess = ChatSession(bundle, codec, batcher, SamplingParams(temperature=0.0), system, reply_tokens)
    t0 = time.time()
    for i, q in enumerate(questions):
        if len(sess.prompt_ids(q)) + reply_tokens + 1 > big:
            say(f"  stopping at {i} turns: the reference cache ({big}) is full")
            questions = questions[:i]
            break
        sess.reply(q)
        say(f"[reference {i + 1}/{len(questions)}] {time.time() - t0:.0f}s  {len(sess.ids)} tokens")
    msgs = sess.messages
    sys_msg = system_turn(system)
    full_ids = codec.chat_ids(sys_msg + msgs, add_generation_prompt=False)
    while len(full_ids) > big and len(msgs) > 2:  # re-tokenized text can run longer than the generated ids
        msgs, questions = msgs[:-2], questions[:-1]
        full_ids = codec.chat_ids(sys_msg + msgs, add_generation_prompt=False)
    turn_spans = [(t, span_of(codec, full_ids, sys_msg + msgs[: 2 * t + 1], msgs[2 * t + 1]["content"]))
                  for t in range(len(questions))]
    turn_spans = [(t, (s, e)) for t, (s, e) in turn_spans if e - s >= 2]  # a reply needs a token to predict
    spans = [sp for _, sp in turn_spans]
    affected = [i for i, (s, e) in enumerate(spans) if e > ctx]  # turns whose history no longer fits

    # 2. full context (oracle), ring, drop-turns
    del sess, batcher  # its cache: the oracle's takes the same memory
    full_gen = rt.stream(big)
    ref = score(full_gen, full_ids, spans)
    k = sink_count(codec, system) if sinks is None else sinks
    ring = score_ring(rt.batcher(ctx, parallel=1, max_queue=1, max_prefixes=0, windowed=True), k, full_ids, spans)
    # a ring prefills only the new message and template glue: from the last reply's end to this one's start
    ring_prefill = [s - prev_e for prev_e, (s, _) in zip([0] + [e for _, e in spans[:-1]], spans)]

    drop_gen = rt.stream(ctx)
    policy, conv = DropTurns(), Conversation(codec, system)
    drop, drop_prefill, prev = [], [], []
    for t, _ in turn_spans:
        conv.messages = [dict(m) for m in msgs[: 2 * t]]
        drop_gen.reset()
        # chat's own rule, with its defaults (max_new_tokens 512: room for a reply of min(512, ctx / 4) tokens)
        target = policy.fit(conv, msgs[2 * t]["content"], drop_gen.seq, 512)
        kept = sys_msg + conv.messages + [msgs[2 * t], msgs[2 * t + 1]]
        ids = codec.chat_ids(kept, add_generation_prompt=False)
        s, e = span_of(codec, ids, kept[:-1], msgs[2 * t + 1]["content"])
        assert s == len(target)
        e = min(e, ctx + 1)  # chat would stop a reply at the cache's end; score what fits
        drop.append(score(drop_gen, ids, [(s, e)])[0])
        drop_prefill.append(len(target) - common_prefix(prev, target))
        prev = ids[: e]

    def metrics(lps, idx):
        kld, top1, nll = [], [], []
        for i in idx:
            n = min(len(ref[i]), len(lps[i]))  # a reply cut at the cache's end is scored as far as it got
            r, p = ref[i][:n], lps[i][:n]
            s = spans[i][0]
            tgt = np.asarray(full_ids[s: s + n])
            kld.extend((np.exp(r) * (r - p)).sum(-1).tolist())
            top1.extend((r.argmax(-1) == p.argmax(-1)).tolist())
            nll.extend((-p[np.arange(len(tgt)), tgt]).tolist())
        n = len(kld)
        return {"tokens": n, "kld_mean": float(np.mean(kld)) if n else 0.0,
                "kld_err": float(np.std(kld, ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
                "top1_pct": 100.0 * float(np.mean(top1)) if n else 100.0,
                "ppl": float(math.exp(np.mean(nll))) if n else 0.0}

    res = {"bundle": str(bundle.path), "ctx": ctx, "turns": len(spans), "reply_tokens": reply_tokens,
           "conversation_tokens": len(full_ids), "sinks": k, "affected_turns": len(affected),
           "full": metrics(ref, affected), "ring": metrics(ring, affected), "drop-turns": metrics(drop, affected),
           "prefill_tokens_per_turn": {"ring": float(np.mean([ring_prefill[i] for i in affected])) if affected else 0.0,
                                       "drop-turns": float(np.mean([drop_prefill[i] for i in affected])) if affected else 0.0},
           "all_turns": {name: metrics(lps, range(len(spans))) for name, lps in (("ring", ring), ("drop-turns", drop))}}
    say(f"\ncontext policies on a {len(full_ids)}-token conversation ({len(spans)} turns), --ctx {ctx}, scored on the "
        f"{len(affected)} turns whose history no longer fits; oracle: the same model with the whole history")
    say(f"{'policy':<11} {'KLD vs full':>18} {'top-1 %':>8} {'reply PPL':>10} {'prefill tok/turn':>17}")
    for name in ("full", "ring", "drop-turns"):
        m = res[name]
        pre = res["prefill_tokens_per_turn"].get(name)
        say(f"{name:<11} {m['kld_mean']:>9.4f} ± {m['kld_err']:<6.4f} {m['top1_pct']:>8.2f} {m['ppl']:>10.4f} "
            f"{'-' if pre is None else f'{pre:.1f}':>17}")
    return res


def cmd_eval_context(args) -> int:
    res = evaluate_context(args.bundle, args.ctx, args.turns, args.reply_tokens, args.system, args.sinks, args.threads)
    if args.json:
        write_json(args.json, res)
        note(f"wrote {args.json}")
    return 0
