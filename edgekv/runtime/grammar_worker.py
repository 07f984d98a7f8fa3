"""Where requests' grammars are built: a small pool of threads of its own (half the cores, at
least one), so that however many grammars arrive at once, at most that many cores build them
and the rest (the batcher's step, the HTTP loop, plain requests' preparation) never wait behind
one. Threads, not processes: llguidance builds and masks with the GIL released, and the matcher
it builds is needed in this process (docs/structured.md has the measurements). Each build holds
to compile_grammar's CPU budget; the memory a finished reply's matcher held is handed back to
the system (glibc keeps freed memory in its arenas otherwise: RSS never went down)."""
from __future__ import annotations

import asyncio
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

from edgekv.runtime.grammar_constraint import GrammarConstraint, compile_grammar
from edgekv.runtime.grammar_engine import Grammar
from edgekv.runtime.grammar_tokenizer import GrammarTokenizer
from edgekv.runtime.memory import CAN_TRIM, give_memory_back

WORKERS = max(1, (os.cpu_count() or 2) // 2)
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="edgekv-grammar")
        return _pool


def compile_bounded(tok: GrammarTokenizer, grammar: Grammar) -> GrammarConstraint:
    """compile_grammar on the grammar pool, waited for here (any thread but the pool's own)."""
    if threading.current_thread().name.startswith("edgekv-grammar"):
        return _watched(compile_grammar(tok, grammar))
    return _watched(pool().submit(compile_grammar, tok, grammar).result())


async def compile_async(tok: GrammarTokenizer, grammar: Grammar) -> GrammarConstraint:
    """compile_grammar on the grammar pool, awaited on the event loop (no thread waits for it)."""
    return _watched(await asyncio.wrap_future(pool().submit(compile_grammar, tok, grammar)))


def _watched(c: GrammarConstraint) -> GrammarConstraint:
    """The constraint, its memory handed back once it is gone (a reply's lexer states are
    llguidance's heap: 16 near-limit replies left ~15-20 MB behind each time, trimmed ~8)."""
    weakref.finalize(c, trim_soon)
    return c


_trim_pending = False


def trim_soon() -> None:
    """give_memory_back on the grammar pool, once for however many constraints went together."""
    global _trim_pending
    with _lock:
        if _trim_pending or not CAN_TRIM:
            return
        _trim_pending = True
    try:
        pool().submit(_trim)
    except RuntimeError:  # the interpreter is exiting: nothing to give back to
        pass


def _trim() -> None:
    global _trim_pending
    with _lock:
        _trim_pending = False
    give_memory_back()


