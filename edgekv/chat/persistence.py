"""A chat saved to a file (/save, /load) and the system prompt's prompt cache (--prompt-cache).

The file is an .npz: `__meta__` (JSON) first, then the KV slots of every buffer, in position
order. The meta holds the format version, the bundle's source checksum and KV scheme (a file only
loads into the same model and scheme), the system prompt, the messages, the token ids fed (a
wrapped ring's: more than its slots; its slots hold the last ones after the sinks) and the ring's
sinks. `ring.w`, the write slot, is the slot count since the cache is a pool of cells: files
written before held their wrapped ring in slot order, the oldest token at slot w, and load in
position order.

Which files are ours: an .npz is a zip, and numpy writes its members in order, so a file edgekv
wrote starts with the zip signature and `__meta__.npy` as its first member's name (SIGNATURE at
offset 0 and 30). A file that starts so (or is empty) is ours: when it cannot be read it is
"ours but damaged" and --prompt-cache rebuilds it; any other file is not ours and is never
overwritten. A load reads and checks the whole file (meta, every array's shape and dtype, the
bundle, ids against the vocab and the slots) before it changes anything.

Which bundle: the source checksum says which model, not which bundle of it. The KV values a bundle
writes depend also on its stored weights (format and group), its compute dtype and its graph
(model.onnx and its data file, by the manifest's sha256), so the meta records those
(`kv_origin`) and a load compares them: a chat saved with the float-weights bundle would
otherwise continue differently in the int4-weights one, silently. A file without the record
(an older edgekv) is refused, since it may come from another bundle of the model; /load! takes
it on the user's word, and a prompt cache without it is rebuilt."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import numpy as np

from edgekv.chat.conversation import sink_count
from edgekv.errors import EdgeKVError
from edgekv.format.files import DiskFull, atomic_open, kind_of
from edgekv.runtime.text import system_turn

FORMAT = 1
SIGNATURE = ((0, b"PK\x03\x04"), (30, b"__meta__.npy"))


def kv_origin(bundle) -> dict:
    """What decides the KV values this bundle writes, beside the model and the KV scheme: the
    stored weights, the compute dtype and the graph files' sha256 (none in an older manifest)."""
    man = bundle.manifest
    onnx, hashes = man["files"]["onnx"], man["files"].get("sha256", {})
    return {"weights": bundle.weights, "group": man["weights"].get("group"), "dtype": bundle.dtype,
            "graph_sha256": {name: h for name, h in sorted(hashes.items()) if name.startswith(onnx)}}


def check_replaceable(path: str, conversation: str) -> None:
    """What a plain /save may replace: nothing, an empty or damaged file of ours, or a saved chat
    of this conversation (`conversation`: its id, which the file's meta records). Anything else
    needs /save! FILE: `/save notes.txt` must not turn notes into a zip, nor `/save c.npz` typed for
    `/load c.npz` replace another conversation's saved chat."""
    if kind_of(path) != "a file" or os.path.getsize(path) == 0:
        return  # nothing to lose (anything but a regular file is refused by the write itself)
    if not is_ours(path):
        raise EdgeKVError(f"{path}: not a saved edgekv chat; refusing to replace it (/save! {path} replaces it)")
    try:
        with np.load(path, allow_pickle=False) as z:
            theirs = json.loads(bytes(z["__meta__"]).decode()).get("conversation")
    except Exception:  # ours but damaged: it cannot be loaded, nothing to keep
        return
    if theirs != conversation:
        raise EdgeKVError(f"{path}: holds another conversation's saved chat; refusing to replace it "
                          f"(/save! {path} replaces it)")


def save(session, path: str) -> None:
    """Write the conversation to `path` (atomically: a Ctrl-C or an error leaves what was there)."""
    bundle, seq = session.bundle, session.seq
    meta = {"edgekv_chat": FORMAT, "bundle_sha256": bundle.manifest["source"].get("sha256"),
            "bundle_scheme": bundle.scheme.name, "kv_origin": kv_origin(bundle),
            "conversation": session.conversation_id, "system": session.system,
            "messages": session.messages, "ids": seq.ids, "ring": {"w": seq.n, "sinks": seq.sinks}}
    snap = session.batcher.snapshot(seq)
    head = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    size = head.nbytes + sum(a.nbytes for a in snap.values())  # at least: the zip's headers come on top
    # a Ctrl-C, a full disk or an error here: the temporary file is removed, the old file stays
    with atomic_open(path, "wb", size=size) as f:
        try:
            # __meta__ first: its name at a fixed offset is how a file is known to be ours (SIGNATURE)
            np.savez(f, __meta__=head, **snap)
        except Exception as e:
            if interrupted(e):  # zipfile's close refuses a member the Ctrl-C left open: it is still a Ctrl-C
                raise KeyboardInterrupt from None
            raise


def interrupted(e: BaseException) -> bool:
    """A KeyboardInterrupt is among the exceptions that led to `e`."""
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__context__
    return False


def is_ours(path: str) -> bool:
    """An empty file or one that starts like a file `save` wrote (SIGNATURE)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise EdgeKVError(f"{path}: cannot read ({e.strerror or e})") from None
    return not head or all(head[at: at + len(sig)] == sig for at, sig in SIGNATURE)


@dataclass
class Saved:
    """A saved chat read and checked against a session, not yet applied."""
    meta: dict
    snap: dict
    n: int
    sinks: int | None  # the ring's sinks it loads with (sinks_for)


def read(session, path: str, trust_unrecorded: bool = False) -> Saved:
    """Read and check the whole file against this session; change nothing. `trust_unrecorded`:
    accept a file that does not record which weights made its KV (/load!)."""
    kind = kind_of(path)
    if kind is None:
        raise EdgeKVError(f"{path}: no such file")
    if kind != "a file":
        raise EdgeKVError(f"{path}: is {kind}, not a saved edgekv chat")
    try:
        with np.load(path, allow_pickle=False) as z:  # never unpickle: an .npz may carry code
            meta = json.loads(bytes(z["__meta__"]).decode())
            snap = {k: z[k] for k in z.files if k != "__meta__"}
    except Exception:  # numpy and zipfile raise many kinds for a damaged or foreign file
        raise EdgeKVError(f"{path}: {unreadable(path)}") from None
    check_meta(meta, path)
    bundle = session.bundle
    diff = origin_difference(meta, bundle)
    if diff:
        raise EdgeKVError(f"{path}: {diff}")
    if "kv_origin" not in meta and not trust_unrecorded:
        raise EdgeKVError(f"{path}: saved by an older edgekv that did not record which weights made its KV cache "
                          f"(it may come from another bundle of this model); /load! {path} loads it anyway")
    ids, vocab = meta["ids"], bundle.model["vocab_size"]
    if any(not 0 <= t < vocab for t in ids):
        raise EdgeKVError(f"{path}: token ids outside the vocabulary of {vocab}")
    sinks = sinks_for(session, meta)
    try:  # every buffer, its shape and dtype (a windowed pool: its ring too), the ids, a ring's write slot
        n = session.batcher.check_restore(session.seq, snap, ids, meta["ring"].get("w"), sinks)
    except EdgeKVError as e:
        raise type(e)(f"{path}: {e}", e.setting, e.fix) from None
    return Saved(meta, snap, n, sinks)


def unreadable(path: str) -> str:
    """Why a file that numpy cannot read is not loaded, in words (no exception class names)."""
    if kind_of(path) == "a file" and os.path.getsize(path) == 0:
        return "empty file, not a saved edgekv chat"
    if is_ours(path):
        return "a damaged saved edgekv chat (truncated or corrupt); it cannot be loaded"
    return "not a saved edgekv chat"


def origin_difference(meta: dict, bundle) -> str | None:
    """How the bundle that saved `meta` differs from `bundle` in what decides the KV values, in
    words (None: the same, or not recorded)."""
    if meta.get("bundle_sha256") != bundle.manifest["source"].get("sha256"):
        return "saved with another model (source sha256 differs)"
    if meta.get("bundle_scheme") != bundle.scheme.name:
        return f"saved with KV scheme {meta.get('bundle_scheme')}, this bundle's is {bundle.scheme.name}"
    saved, here = meta.get("kv_origin"), kv_origin(bundle)
    if saved is None:
        return None
    if (saved["weights"], saved["group"]) != (here["weights"], here["group"]):
        return f"saved with {weights_words(saved)}, this bundle has {weights_words(here)}"
    if saved["dtype"] != here["dtype"]:
        return f"saved with {saved['dtype']} compute, this bundle computes in {here['dtype']}"
    a, b = saved["graph_sha256"], here["graph_sha256"]
    for name in sorted(set(a) | set(b)):
        if a.get(name) != b.get(name):
            return (f"saved with another {name} (sha256 {(a.get(name) or 'unrecorded')[:12]}, this bundle's "
                    f"{(b.get(name) or 'unrecorded')[:12]})")
    return None


def weights_words(origin: dict) -> str:
    group = f" (group {origin['group']})" if origin["group"] else ""
    return f"{origin['weights']} weights{group}"


def sinks_for(session, meta: dict) -> int | None:
    """The sinks a ring session takes from a file: the file's own (a ring's), else those of the
    file's system prompt, as the ring policy counts them; None for a session without a ring."""
    if not session.seq.ring:
        return None
    sinks = meta["ring"].get("sinks")
    if sinks is None:
        sinks = sink_count(session.codec, meta["system"])
    if not 0 <= sinks <= session.seq.capacity // 2:
        raise EdgeKVError(f"the saved system prompt takes {sinks} sink cells; this ring keeps at most "
                          f"{session.seq.capacity // 2}", setting="capacity", fix="raise {}")
    return sinks


_META = {"edgekv_chat": int, "system": (str, type(None)), "messages": list, "ids": list, "ring": dict}
_ORIGIN = {"weights": str, "group": (int, type(None)), "dtype": str, "graph_sha256": dict}


def check_meta(meta, path: str) -> None:
    def bad(what):
        return EdgeKVError(f"{path}: not a saved edgekv chat ({what})")

    if not isinstance(meta, dict) or meta.get("edgekv_chat") != FORMAT:
        raise bad("no edgekv_chat header of version %d" % FORMAT)
    for key, typ in _META.items():
        if key not in meta or not isinstance(meta[key], typ):
            raise bad(f"{key} missing or of the wrong type")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in meta["ids"]):
        raise bad("ids are not all integers")
    for m in meta["messages"]:
        if not (isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)):
            raise bad("a message is not a {role, content} pair")
    for key in ("w", "sinks"):
        v = meta["ring"].get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise bad(f"ring.{key} is not a cell count")
    if not isinstance(meta.get("conversation", ""), str):
        raise bad("conversation is not an id")
    origin = meta.get("kv_origin")
    if origin is not None and not (isinstance(origin, dict) and all(
            isinstance(origin.get(k), t) for k, t in _ORIGIN.items()) and all(
            isinstance(h, str) for h in origin["graph_sha256"].values())):
        raise bad("kv_origin is not a record of weights, group, dtype and graph sha256")


def restore(session, saved: Saved) -> None:
    """Put a checked file's cells and ids into the session's sequence (Batcher.restore: all or
    nothing); the conversation's messages are the session's to set (ChatSession.load)."""
    session.batcher.restore(session.seq, saved.snap, saved.meta["ids"], w=saved.meta["ring"].get("w"),
                           sinks=saved.sinks)


def warm_system(session, prompt_cache: str | None) -> str:
    """Prefill the system prompt alone, or restore its KV from `prompt_cache` when that file
    was made for this bundle and this exact system prompt. A file of ours that is stale or
    damaged is rebuilt; anything else at that path is refused, never overwritten."""
    if not session.system:
        return "no system prompt"
    ids = session.codec.chat_ids(system_turn(session.system), add_generation_prompt=False)
    if prompt_cache:
        kind = kind_of(prompt_cache)
        if kind not in (None, "a file"):
            raise EdgeKVError(f"{prompt_cache}: is {kind}, not a prompt cache; refusing to replace it")
        if kind == "a file":
            if not is_ours(prompt_cache):
                raise EdgeKVError(f"{prompt_cache}: not an edgekv prompt cache; refusing to overwrite it "
                                  f"(choose another file)")
            restored = _restore(session, prompt_cache, ids)
            if restored:
                return restored
    t0 = time.perf_counter()
    session.prefill(ids)
    took = time.perf_counter() - t0
    if prompt_cache:
        try:
            save(session, prompt_cache)
        except DiskFull as e:  # a cache: the chat goes on without it
            return f"prefilled {len(ids)} system-prompt tokens in {took * 1000:.0f} ms, not saved ({e})"
        return f"prefilled {len(ids)} system-prompt tokens in {took * 1000:.0f} ms, saved to {prompt_cache}"
    return f"prefilled {len(ids)} system-prompt tokens in {took * 1000:.0f} ms"


def _restore(session, path: str, ids: list[int]) -> str | None:
    """Restore the system prompt's KV from our file if it is for exactly this prompt (None if not)."""
    t0 = time.perf_counter()
    try:
        saved = read(session, path)
    except EdgeKVError:
        return None  # ours but damaged, or for another bundle: rebuilt
    m = saved.meta
    if m["system"] != session.system or m["ids"] != ids or m["messages"]:
        return None
    session.batcher.restore(session.seq, saved.snap, ids, w=m["ring"].get("w"), sinks=saved.sinks)
    return f"restored {len(ids)} system-prompt tokens from {path} in {(time.perf_counter() - t0) * 1000:.0f} ms"
