"""The process's signals under `edgekv serve` (SIGTERM, SIGINT: the first drains, a second stops
at once) and systemd's notify socket (Type=notify: READY=1, STOPPING=1)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading

from edgekv.errors import note


# -- the process's signals
class Stop(BaseException):
    """Raised on the main thread by a signal that must end what it is doing now (while loading or
    warming up, or a second signal while draining). A BaseException, as KeyboardInterrupt is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Signals:
    """SIGTERM and SIGINT on the main thread. While urgent (starting, warming up, draining) a
    signal is kept and `check()`, called between those steps, raises Stop - never inside them
    (half through starting a thread or holding a lock it left serve hung or crashing at exit) -
    except `immediately()`, around loading the runtime (nothing of ours half-made there), where
    it raises Stop at once; while serving, the first one only wakes `wait_first`."""

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.urgent = True
        self.defer = True  # an urgent signal waits for check(), but inside immediately()
        self.stopped = False
        self.first: int | None = None
        self.pending: int | None = None  # a signal that came while urgent: check() stops on it
        self._got = threading.Event()
        self._old: dict = {}

    def __enter__(self) -> "Signals":
        self._old = {s: signal.signal(s, self._handle) for s in self.HANDLED}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum, frame) -> None:
        if self.stopped:
            return  # already stopping at once: let the cleanup finish
        if self.urgent:
            self.stopped, self.pending = True, signum  # kept even where Stop is raised: see immediately()
        else:
            self.first = signum
        self._got.set()
        if self.urgent and not self.defer:
            raise Stop(signum)

    @contextlib.contextmanager
    def immediately(self):
        """Inside: a signal raises Stop where it lands (loading the runtime: minutes on a board). Code
        inside may swallow it (pybind11 turns an exception raised during onnxruntime's module init into
        an ImportError, and the backend falls back to the next provider or reports onnxruntime missing),
        so after a signal whatever the load ends with is this Stop."""
        self.check()
        self.defer = False
        try:
            yield
        except BaseException:
            if self.pending is None:
                raise
            raise Stop(self.pending) from None
        finally:
            self.defer = True
        self.check()

    def check(self) -> None:
        """A safe point while loading or draining: a signal that came stops here."""
        if self.pending is not None:
            raise Stop(self.pending)

    def serving(self) -> None:
        self.urgent = False

    def ignore(self) -> None:
        """From now on signals change nothing (the cleanup at exit is short and must finish)."""
        self.stopped = True

    def wait_first(self) -> int | None:
        while not self._got.wait(0.5):
            pass
        self.urgent = True  # from now on (draining) a signal stops at the next check
        self.check()  # one that came before serving began: nothing is being served, stop
        return self.first


def notify(state: str) -> None:
    """Tell systemd (Type=notify: NOTIFY_SOCKET) what we are doing; nothing without it."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    addr = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(state.encode(), addr)
    except OSError as e:
        note(f"edgekv serve: warning: could not notify systemd at {path}: {e.strerror or e}")
