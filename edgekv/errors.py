"""Every error meant for the user, and the one helper that writes notes to stderr.

Library code says what is wrong; when the fix is to change a setting, the error names the
setting (`setting`, one of SETTINGS) and how to change it (`fix`, a phrase where `{}` stands for
the setting). The command line turns the setting into its flag (edgekv/cli.py); elsewhere the
setting's own words are used."""
from __future__ import annotations

import sys

# setting -> how it is called outside the command line
SETTINGS = {
    "capacity": "the cache capacity",
    "context_policy": "the context policy",
    "max_context": "the bundle's verified context (at export)",
    "max_prefill": "the engine's tokens per prefill call",
    "prefix_windows": "the prefix cache's window copies",
}


class EdgeKVError(Exception):
    """An error for the user: the CLI prints its message as one line and exits non-zero."""

    def __init__(self, message: str, setting: str | None = None, fix: str = ""):
        super().__init__(message)
        if setting is not None and setting not in SETTINGS:
            raise ValueError(f"unknown setting {setting!r}")
        self.setting, self.fix = setting, fix

    def explain(self, names: dict[str, str] | None = None) -> str:
        """The message with its fix, the setting called by `names` (default: its words)."""
        if self.setting is None:
            return str(self)
        name = (names or SETTINGS).get(self.setting, SETTINGS[self.setting])
        return f"{self} ({self.fix.format(name)})"


class ContextOverflow(EdgeKVError):
    """More tokens than the cache (or the bundle's verified positions) can hold."""


class BundleError(EdgeKVError):
    """A bundle that cannot be used."""


class BackendUnavailable(EdgeKVError):
    """A backend whose libraries or hardware are missing here (one line says what is needed)."""


class ExportError(EdgeKVError):
    """A model that cannot be exported (or an export that failed its checks)."""


def note(msg: str) -> None:
    """A progress line or a note for the user: stderr, flushed, so stdout stays the answer."""
    print(msg, file=sys.stderr, flush=True)


class QueueFull(EdgeKVError):
    """The server's wait queue is full (HTTP 429)."""


class NonFinite(EdgeKVError):
    """The model produced NaN or infinite logits: damaged weights, or an overflow."""

    MESSAGE = ("the model produced non-finite logits (NaN or infinity); the bundle's weights may be damaged: "
               "check them with `edgekv verify BUNDLE`")

    def __init__(self, message: str = MESSAGE):
        super().__init__(message)
