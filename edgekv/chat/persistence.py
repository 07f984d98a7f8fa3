"""A chat saved to a file (/save, /load) and the system prompt's prompt cache (--prompt-cache).

The file is an .npz: the filled KV slots of every buffer, plus `__meta__` (JSON): the format
version, the bundle's source checksum and KV scheme (a file only loads into the same model and
scheme), the system prompt, the messages, the token ids in the cache and the ring's write slot
and sinks."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.runtime.text import system_turn

FORMAT = 1


def save(session, path: str) -> None:
    p = Path(path)
    bundle, seq = session.bundle, session.gen.seq
    meta = {"edgekv_chat": FORMAT, "bundle_sha256": bundle.manifest["source"].get("sha256"),
            "bundle_scheme": bundle.scheme.name, "system": session.system, "messages": session.messages,
            "ids": seq.ids, "ring": {"w": seq.w, "sinks": seq.sinks}}
    snap = session.gen.snapshot()
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **snap)
    tmp.replace(p)


def load(session, path: str) -> None:
    try:
        z = np.load(path)
        meta = json.loads(bytes(z["__meta__"]).decode())
        snap = {k: z[k] for k in z.files if k != "__meta__"}
    except (OSError, ValueError, KeyError) as e:
        raise EdgeKVError(f"{path}: not a saved edgekv chat ({type(e).__name__})") from None
    bundle = session.bundle
    if (meta.get("bundle_sha256"), meta.get("bundle_scheme")) != (bundle.manifest["source"].get("sha256"),
                                                                 bundle.scheme.name):
        raise EdgeKVError(f"{path}: saved with another model or KV scheme")
    ring = meta.get("ring") or {}
    if ring.get("w") is not None and ring.get("w") != len(meta["ids"]) and not session.gen.seq.ring:
        raise EdgeKVError(f"{path}: saved from a ring cache that has wrapped", setting="context_policy",
                          fix="load it with {} ring")
    session.gen.restore(snap, meta["ids"], w=ring.get("w"))
    session.system, session.messages = meta["system"], meta["messages"]


def warm_system(session, prompt_cache: str | None) -> str:
    """Prefill the system prompt alone, or restore its KV from `prompt_cache` when that file
    was made for this bundle and this exact system prompt (anything else is rebuilt)."""
    if not session.system:
        return "no system prompt"
    ids = session.codec.chat_ids(system_turn(session.system), add_generation_prompt=False)
    if prompt_cache and Path(prompt_cache).is_file():
        wanted = session.system
        t0 = time.perf_counter()
        try:
            load(session, prompt_cache)
            if session.system == wanted and session.ids == ids and not session.messages:
                took = time.perf_counter() - t0
                return f"restored {len(ids)} system-prompt tokens from {prompt_cache} in {took * 1000:.0f} ms"
        except EdgeKVError:
            pass
        session.system = wanted
        session.reset()
    t0 = time.perf_counter()
    session.gen.reset()
    session.gen.prefill(ids)
    took = time.perf_counter() - t0
    if prompt_cache:
        save(session, prompt_cache)
        return f"prefilled {len(ids)} system-prompt tokens in {took * 1000:.0f} ms, saved to {prompt_cache}"
    return f"prefilled {len(ids)} system-prompt tokens in {took * 1000:.0f} ms"
