"""`edgekv chat`: streaming multi-turn chat that keeps its KV cache between turns.

Each turn renders the whole conversation with the bundle's chat template, finds the longest
prefix already fed (token ids are tracked) and prefills only the rest: the new message and the
template glue. When the conversation outgrows the cache (--context):
  ring (default)  the first tokens (system prompt, attention sinks) stay, the oldest of the rest
                  are overwritten (StreamingLLM); nothing is prefilled again. When positions reach
                  the bundle's verified context, old turns are dropped once and the kept ones
                  re-prefilled from position 0.
  drop-turns      whole old exchanges are dropped and the kept turns prefilled again.
`edgekv eval-context` measured the ring closer to the full-history model (half the KL
divergence) at a tenth of the prefill; docs/chat.md."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from edgekv.commands import open_runtime, sampling_from
from edgekv.errors import EdgeKVError
from edgekv.generate import SamplingParams, Stats
from edgekv.text import StreamDecoder, system_turn

HELP = """commands:
  /help            this help
  /reset           forget the conversation (keeps the system prompt)
  /undo            forget the last exchange (the cache is truncated, not recomputed)
  /system TEXT     set a new system prompt (resets the conversation)
  /stats           cache and speed of the last reply
  /save FILE       save the conversation and its KV cache
  /load FILE       load a saved conversation (same bundle only)
  /quit            exit (Ctrl-D too); Ctrl-C stops a reply"""


CONTEXT_POLICIES = ("ring", "drop-turns")


def sink_count(codec, system: str | None) -> int:
    """Tokens before the first user message's text: the system prompt and its template glue."""
    a = codec.chat_ids(system_turn(system) + [{"role": "user", "content": "alpha"}])
    b = codec.chat_ids(system_turn(system) + [{"role": "user", "content": "omega"}])
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ChatSession:
    def __init__(self, bundle, codec, gen, params: SamplingParams, system: str | None, max_new_tokens: int,
                 context: str = "drop-turns"):
        if context not in CONTEXT_POLICIES:
            raise EdgeKVError(f"unknown context policy {context!r}; choose {' or '.join(CONTEXT_POLICIES)}")
        self.bundle, self.codec, self.gen = bundle, codec, gen
        self.params, self.max_new = params, max_new_tokens
        self.rng = np.random.default_rng(params.seed)
        self.system = system
        self.ring = context == "ring" and getattr(gen.backend, "ring_ok", True)
        self.note = "" if self.ring or context != "ring" else \
            f"(context policy: drop-turns; the {gen.backend.name} backend cannot run a ring)"
        self._set_sinks()
        self.messages: list[dict] = []
        self.ids: list[int] = []  # token ids held by the cache, slot by slot
        self.last = Stats()
        self.dropped_turns = 0

    def _set_sinks(self) -> None:
        """Ring: the system prompt's slots are the sinks (at most half the cache)."""
        if self.ring:
            c = self.gen.cache
            c.sinks = None  # re-armed below; only called with an empty cache
            c.enable_ring(min(sink_count(self.codec, self.system), c.capacity // 2))

    def _room(self) -> int:
        """Tokens that may still be fed: the cache's room, and for a ring the positions left."""
        return min(self.gen.cache.room(), self.bundle.max_context - self.gen.pos)

    # -- conversation -------------------------------------------------------------------------
    def _msgs(self, extra=()):
        return system_turn(self.system) + self.messages + list(extra)

    def _render(self, msgs) -> list[int]:
        """Token ids of the conversation `msgs` plus the generation prompt. Where the rendered text
        only appends to what the cache holds, the cached ids are kept as they are (re-tokenizing a
        generated reply can split it differently) and only the appended text is tokenized."""
        new_text = self.codec.render(msgs, add_generation_prompt=True)
        if self.ids:
            held = self.codec.tok.decode(self.ids, skip_special_tokens=False)
            if new_text.startswith(held):
                return list(self.ids) + self.codec.encode(new_text[len(held):])
        return self.codec.encode(new_text)

    def _keep_common_prefix(self, target: list[int]) -> int:
        """Truncate the cache to the longest prefix it shares with `target`; return its length.
        A ring that has wrapped cannot be truncated (its slots are out of order): it starts over."""
        n = 0
        for a, b in zip(self.ids, target):
            if a != b:
                break
            n += 1
        if n < len(self.ids):
            if self.gen.cache.wrapped:
                self.gen.reset()
                n = 0
            else:
                self.gen.truncate(n)
        self.ids = self.ids[:n]
        return n

    def _sync(self, target: list[int]) -> int:
        """Make the cache hold `target`: keep the common prefix, prefill the rest. Returns the
        number of tokens prefilled."""
        n = self._keep_common_prefix(target)
        if n == len(target):  # the model needs at least one new token to produce logits
            n = self._keep_common_prefix(target[:-1])
        self._logits = self.gen.prefill(target[n:]).copy()
        self.ids = list(target)  # only now: an interrupted prefill leaves ids at the common prefix
        return len(target) - n

    def _fit(self, user: str) -> list[int]:
        """Token ids for the conversation + the new message, dropping old turns until the prompt
        leaves room for a reply."""
        cap = self.gen.cache.capacity
        room_for_reply = min(self.max_new, cap // 4)
        target = self._render(self._msgs([{"role": "user", "content": user}]))
        # a ring overwrites what does not fit in the cache, but positions must stay verified: it
        # keeps going while a whole reply (--max-new-tokens) still has positions left
        if self.ring and len(target) + min(self.max_new, self.bundle.max_context // 4) <= self.bundle.max_context:
            return target
        while len(target) + room_for_reply > cap and self.messages:
            # drop the oldest exchange (user + assistant) as a whole
            self.messages = self.messages[2:] if len(self.messages) >= 2 else []
            self.dropped_turns += 1
            target = self._render(self._msgs([{"role": "user", "content": user}]))
        if len(target) >= cap:
            raise EdgeKVError(f"message too long: {len(target)} tokens with the system prompt, the cache holds "
                              f"{cap} (raise --ctx)")
        return target

    def reply(self, user: str, write=None):
        """Answer one user message; stream text pieces to `write`. Returns (text, Stats).
        Ctrl-C (KeyboardInterrupt) stops the reply wherever it is; the cache stays consistent
        because `self.ids` only ever lists slots that were written."""
        write = write or (lambda s: None)
        st = Stats()
        t0 = time.perf_counter()
        dec = StreamDecoder(self.codec)
        pieces = []
        try:
            target = self._fit(user)
            self.last_prompt_ids = list(target)
            st.prompt_tokens = self._sync(target)  # only what the cache did not already hold
            st.prefill_s = time.perf_counter() - t0
            self._decode(st, dec, pieces, write, t0)
        except KeyboardInterrupt:
            st.stop_reason = "interrupted"
            self._resync()
        tail = dec.flush()
        if tail:
            pieces.append(tail)
            write(tail)
        text = "".join(pieces)
        if st.prefill_s or text:  # a turn interrupted before it was even read is not recorded
            self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
        self.last = st
        return text, st

    def _resync(self) -> None:
        """After Ctrl-C: the cache may hold slots `self.ids` does not list (chunks of a prefill
        cut short, or a decode step whose graph call finished just before the signal). Cut them
        off; a wrapped ring cannot be cut, so it starts over (the next turn prefills it all)."""
        c, n = self.gen.cache, len(self.ids)
        if self.gen.pos == n and (c.n == c.w == n if not c.wrapped else c.w == self._ring_slot(n)):
            return
        if not c.wrapped and c.n >= n:
            self.gen.truncate(n)
        else:
            self.gen.reset()
            self.ids = []

    def _ring_slot(self, fed: int) -> int:
        """A wrapped ring's write slot after `fed` tokens from position 0."""
        c = self.gen.cache
        return c.sinks + (fed - c.sinks) % (c.capacity - c.sinks)

    def _decode(self, st: Stats, dec: StreamDecoder, pieces: list, write, t0: float) -> None:
        for tok in self.gen.decode(self._logits, self.max_new, self.params, self.rng, self.codec.stop_ids,
                                   list(self.ids), st, t0, room=self._room, keep_turn=True, on_fed=self.ids.append):
            piece = dec.push(tok)
            if piece:
                pieces.append(piece)
                write(piece)

    def undo(self) -> bool:
        if len(self.messages) < 2:
            return False
        self.messages = self.messages[:-2]
        # the cache keeps what still matches; the next turn prefills only the difference
        self._keep_common_prefix(self._render(self._msgs()))
        return True

    def reset(self) -> None:
        self.messages = []
        self.gen.reset()
        self.ids = []
        self._set_sinks()  # the system prompt may have changed

    def stats_line(self) -> str:
        st, c = self.last, self.gen.cache
        mib = 2 ** 20
        return (f"TTFT {st.ttft_s * 1000:.0f} ms | prefill {st.prompt_tokens} tok @ {st.prefill_tps:.0f} tok/s | "
                f"decode {st.new_tokens} tok @ {st.decode_tps:.1f} tok/s | KV {c.n}/{c.capacity} slots, "
                f"{c.used_bytes() / mib:.2f}/{c.nbytes / mib:.2f} MiB"
                + (" | ring: oldest tokens overwritten" if c.wrapped else "")
                + (f" | {self.dropped_turns} old turn(s) dropped" if self.dropped_turns else ""))

    def warm_system(self, prompt_cache: str | None) -> str:
        """Prefill the system prompt alone, or restore its KV from `prompt_cache` when that file
        was made for this bundle and this exact system prompt (anything else is rebuilt)."""
        if not self.system:
            return "no system prompt"
        ids = self.codec.chat_ids(system_turn(self.system), add_generation_prompt=False)
        if prompt_cache and Path(prompt_cache).is_file():
            wanted = self.system
            t0 = time.perf_counter()
            try:
                self.load(prompt_cache)
                if self.system == wanted and self.ids == ids and not self.messages:
                    took = time.perf_counter() - t0
                    return f"restored {len(ids)} system-prompt tokens from {prompt_cache} in {took * 1000:.0f} ms"
            except EdgeKVError:
                pass
            self.system = wanted
            self.messages = []
            self.reset()
        t0 = time.perf_counter()
        self.gen.reset()
        self.gen.prefill(ids)
        self.ids = list(ids)
        took = time.perf_counter() - t0
        if prompt_cache:
            self.save(prompt_cache)
            return f"prefilled {len(ids)} system-prompt tokens in {took * 1000:.0f} ms, saved to {prompt_cache}"
        return f"prefilled {len(ids)} system-prompt tokens in {took * 1000:.0f} ms"

    # -- persistence --------------------------------------------------------------------------
    def save(self, path: str) -> None:
        p = Path(path)
        meta = {"edgekv_chat": 1, "bundle_sha256": self.bundle.manifest["source"].get("sha256"),
                "bundle_scheme": self.bundle.scheme.name, "system": self.system, "messages": self.messages,
                "ids": self.ids, "ring": {"w": self.gen.cache.w, "sinks": self.gen.cache.sinks}}
        snap = self.gen.cache.snapshot()
        tmp = p.with_name(p.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **snap)
        tmp.replace(p)

    def load(self, path: str) -> None:
        try:
            z = np.load(path)
            meta = json.loads(bytes(z["__meta__"]).decode())
            snap = {k: z[k] for k in z.files if k != "__meta__"}
        except (OSError, ValueError, KeyError) as e:
            raise EdgeKVError(f"{path}: not a saved edgekv chat ({type(e).__name__})") from None
        if (meta.get("bundle_sha256"), meta.get("bundle_scheme")) != (self.bundle.manifest["source"].get("sha256"),
                                                                     self.bundle.scheme.name):
            raise EdgeKVError(f"{path}: saved with another model or KV scheme")
        ring = meta.get("ring") or {}
        if ring.get("w") is not None and ring.get("w") != len(meta["ids"]) and not self.ring:
            raise EdgeKVError(f"{path}: saved from a ring cache that has wrapped; load it with --context ring")
        self.gen.cache.restore(snap, w=ring.get("w"))
        self.gen.pos = len(meta["ids"])  # positions run with the conversation, also past a ring's wrap
        self.system, self.messages, self.ids = meta["system"], meta["messages"], meta["ids"]


def cmd_chat(args) -> int:
    bundle, codec, gen = open_runtime(args.bundle, args.ctx, args.backend, args.threads)
    session = ChatSession(bundle, codec, gen, sampling_from(args), args.system, args.max_new_tokens, args.context)
    interactive = sys.stdin.isatty() and not args.json
    if session.note:
        print(session.note, file=sys.stderr)
    if args.system or args.prompt_cache:
        note = session.warm_system(args.prompt_cache)
        if interactive or args.prompt_cache:
            print(f"({note})", file=sys.stderr)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"edgekv chat — {bundle.manifest.get('name', bundle.path.name)}, KV {bundle.scheme.name}, "
              f"ctx {gen.cache.capacity}. /help for commands, Ctrl-D to quit.", file=sys.stderr)
    dim = ("\033[2m", "\033[0m") if sys.stderr.isatty() else ("", "")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            if interactive:
                print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /quit to exit)", file=sys.stderr)
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if handle_command(session, line) == "quit":
                return 0
            continue
        out = sys.stdout
        write = (lambda s: (out.write(s), out.flush())) if not args.json else None
        text, st = session.reply(line, write)
        if args.json:
            print(json.dumps({"user": line, "text": text, **asdict(st), "prefill_tps": st.prefill_tps,
                              "decode_tps": st.decode_tps, "kv_slots": gen.cache.n, "kv_capacity": gen.cache.capacity,
                              "kv_bytes_used": gen.cache.used_bytes(), "dropped_turns": session.dropped_turns,
                              "context": args.context, "ring_wrapped": gen.cache.wrapped, "position": gen.pos}),
                  flush=True)
        else:
            out.write("\n")
            out.flush()
            if st.stop_reason == "interrupted":
                print("[stopped]", file=sys.stderr)
            print(f"{dim[0]}{session.stats_line()}{dim[1]}", file=sys.stderr, flush=True)


def handle_command(s: ChatSession, line: str):
    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    err = sys.stderr
    try:
        if cmd in ("/quit", "/exit"):
            return "quit"
        if cmd == "/help":
            print(HELP, file=err)
        elif cmd == "/reset":
            s.reset()
            print("(conversation forgotten)", file=err)
        elif cmd == "/undo":
            print("(last exchange forgotten)" if s.undo() else "(nothing to undo)", file=err)
        elif cmd == "/system":
            if not arg:
                print(f"(system prompt: {s.system!r}; /system TEXT sets it)", file=err)
            else:
                s.system = arg
                s.reset()
                print("(system prompt set; conversation reset)", file=err)
        elif cmd == "/stats":
            print(s.stats_line(), file=err)
        elif cmd == "/save":
            if not arg:
                raise EdgeKVError("/save FILE")
            s.save(arg)
            print(f"(saved to {arg})", file=err)
        elif cmd == "/load":
            if not arg:
                raise EdgeKVError("/load FILE")
            s.load(arg)
            print(f"(loaded {arg}: {len(s.messages) // 2} exchange(s), {s.gen.cache.n} cached tokens)", file=err)
        else:
            print(f"unknown command {cmd}; /help lists the commands", file=err)
    except EdgeKVError as e:
        print(f"error: {e}", file=err)
    return None
