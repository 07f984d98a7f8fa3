"""The default evaluation text: `edgekv eval` scores it and the exporter's held-out check of a
static KV calibration reads it (export/calibrate.py never does)."""
from __future__ import annotations


def default_text() -> tuple[str, str]:
    """An English corpus that ships with every Python: the pydoc topics help text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics (Python stdlib help text)"
