"""What one export is asked to do: one object, built once (from `edgekv export`'s command line or
from export_bundle's keywords) and checked when it is made, before anything is read or written."""
from __future__ import annotations

from dataclasses import dataclass

from edgekv.errors import ExportError
from edgekv.format.bundle import WEIGHT_FORMATS
from edgekv.format.kvschemes import get_scheme
from export.kv_gate import AUTO
from export.weights import GROUPS, METHODS

WEIGHT_DEFAULT = "auto"  # `edgekv export --weights`: keep what the source holds (recipes.source_weights)
WEIGHT_CHOICES = (WEIGHT_DEFAULT, *WEIGHT_FORMATS)


@dataclass(frozen=True)
class ExportOptions:
    """The library's default weights stay float (the tests' float-weights reference bundle is made
    by this default); `edgekv export` defaults to auto (WEIGHT_DEFAULT)."""
    model: str | None = None  # a recipe name, a Hugging Face folder or a .gguf file (None: the default recipe)
    kv: str = "int8"  # `edgekv export` defaults to auto: int8-static where its held-out check holds, else int8
    out: str | None = None  # None: models/bundles/NAME-KV...
    max_context: int | None = None  # None: the recipe's, else min(model, 4096)
    dtype: str = "float32"
    steps: int = 32  # decode steps in the parity check
    threads: int | None = None
    calib_text: str | None = None
    calib_tokens: int = 4096
    force: bool = False
    weights: str = "float"
    group: int = 32
    method: str = "awq"
    requantize: bool = False

    def __post_init__(self):
        try:
            self.kv == AUTO or get_scheme(self.kv)
        except ValueError as e:
            raise ExportError(str(e)) from None
        if self.weights not in WEIGHT_CHOICES:
            raise ExportError(f"unknown weight format {self.weights!r}; known: {', '.join(WEIGHT_CHOICES)}")
        if self.group not in GROUPS:
            raise ExportError(f"--group {self.group}: choose one of {', '.join(map(str, GROUPS))}")
        if self.method not in METHODS:
            raise ExportError(f"--requant-method {self.method}: choose one of {', '.join(METHODS)}")

    @classmethod
    def from_args(cls, args) -> ExportOptions:
        """From `edgekv export`'s parsed command line (edgekv/cli.py)."""
        return cls(model=args.model, kv=args.kv, out=args.out, max_context=args.max_context, dtype=args.dtype,
                   steps=args.steps, threads=args.threads, calib_text=args.calib_text, calib_tokens=args.calib_tokens,
                   force=args.force, weights=args.weights, group=args.group, method=args.requant_method,
                   requantize=args.requantize)

    @property
    def calib(self) -> tuple[str | None, int]:
        return self.calib_text, self.calib_tokens
