"""The end of a drain that ran out of time (docs/serve.md, "Stopping: the drain"): what is still
running when --drain-seconds have passed is cut so that its client hears why, never a connection
that just stops. Each reply being written gets CUT in its queue: a streamed one ends with an SSE
error event and `data: [DONE]`, a whole one is a 503 JSON error, and the access line of each says
`cut`. The replies get CUT_GRACE seconds to send that; only a connection still open then is
closed under them.

`LiveReplies` is the app's list of the replies being written (edgekv/serve/app.py registers each;
the drain on the main thread cuts them all: each reply's queue is fed on its own event loop)."""
from __future__ import annotations

import asyncio
import threading
import time
import weakref

CUT = object()  # in a reply's queue beside the batcher's events: the drain ran out
CUT_GRACE = 2.0  # seconds the cut replies have to send their last event before connections close
CUT_CODE = "server_shutting_down"


class LiveReplies:
    """The replies being written; `cut(message)` ends each of them (and any that starts later)."""

    def __init__(self):
        self._lock = threading.Lock()
        # reply -> (its event loop, its queue); weak: a reply whose stream never started is no leak
        self._live: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.message: str | None = None  # set once cut: why every reply ends

    def add(self, reply, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        """On the reply's loop. A reply that starts after the cut is cut at once."""
        with self._lock:
            self._live[reply] = (loop, queue)
            late = self.message is not None
        if late:
            queue.put_nowait(CUT)

    def discard(self, reply) -> None:
        with self._lock:
            self._live.pop(reply, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def cut(self, message: str) -> int:
        """From any thread: every reply being written ends with `message`; how many there were."""
        with self._lock:
            self.message = message
            live = list(self._live.values())
        for loop, queue in live:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, CUT)
            except RuntimeError:  # its loop is closed: the reply is gone with it
                pass
        return len(live)


def emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
    """The batcher's `emit` for one reply: each event into `queue`, on `loop`; nothing once that
    loop is closed (the HTTP server stopped while the engine still ends the requests it cut: its
    thread must not die of it)."""
    def emit(event) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
    return emit


def cut_the_rest(server, http, seconds: float, check=lambda: None, grace: float = CUT_GRACE) -> int:
    """The drain's time is up: every reply still being written ends with one error saying so (the
    stream's last event before [DONE], or the 503 a whole reply gets), then up to `grace` seconds
    for those last events to go out (`check()`: a second signal stops the wait). Returns the
    requests still in flight after that (their connections are the caller's to close)."""
    server.live.cut(f"the server is shutting down: its drain (--drain-seconds {seconds:g}) ran out before this reply "
                    "was finished, so it was cut here; retry on another server")
    deadline = time.monotonic() + grace
    while http.in_flight() and time.monotonic() < deadline:
        time.sleep(0.02)
        check()
    return http.in_flight()
