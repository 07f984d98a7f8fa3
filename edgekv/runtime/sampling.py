"""Sampling: greedy, temperature, top-k, top-p, repetition penalty."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgekv.errors import BundleError
from edgekv.format.bundle import MANIFEST

# Temperatures below float32's smallest normal number are greedy: the logits are divided in float32,
# where such a temperature is subnormal (1/T within 4x of float32's largest number, so every logit
# more than 4 below the max overflows to -inf) or, below 1.4e-45, rounds to 0 (0 / 0 = NaN at the
# max). The distribution they ask for is the argmax, up to exact ties.
GREEDY_BELOW = float(np.finfo(np.float32).tiny)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW): greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # 0: off
    seed: int | None = None


# what a manifest's `sampling` may hold: key -> (type, lowest, highest, lowest excluded); the
# CLI's ranges (edgekv/cli/args.py)
SAMPLING_KEYS = {"temperature": (float, 0.0, 100.0, False), "top_p": (float, 0.0, 1.0, True),
                 "top_k": (int, 0, 1 << 22, False), "repeat_penalty": (float, 0.0, 100.0, True)}
FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "repeat_penalty": "--repeat-penalty"}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves sampling unset gets (generate, chat and serve alike): the
    model's own (its manifest's `sampling`), a server-wide flag over them, or OpenAI's defaults
    (temperature 1, top_p 1) where nothing gives one. `source` says which, for the load line."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repeat_penalty: float = 1.0
    source: str = "OpenAI's defaults"

    def params(self, seed: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              repeat_penalty=self.repeat_penalty, seed=seed)

    def record(self) -> dict:
        """As /v1/models shows them."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "repeat_penalty": self.repeat_penalty, "source": self.source}

    def line(self) -> str:
        """As the load line says them: 'temperature 0.2, top_p 0.9 (the model's: ...)'."""
        shown = [f"temperature {self.temperature:g}" + (" (greedy)" if self.temperature < GREEDY_BELOW else "")]
        shown += [f"top_p {self.top_p:g}"] if self.top_p < 1.0 else []
        shown += [f"top_k {self.top_k}"] if self.top_k else []
        shown += [f"repeat penalty {self.repeat_penalty:g}"] if self.repeat_penalty != 1.0 else []
        return f"{', '.join(shown)} ({self.source})"


# a bundle whose manifest has no `sampling` (exported before edgekv recorded the model's defaults):
# what `edgekv generate` did by default then, greedy with its repeat guard, in every command
UNRECORDED = dict(temperature=0.0, top_p=1.0, top_k=0, repeat_penalty=1.1)


def check_sampling(sampling) -> str | None:
    """What is wrong with a manifest's `sampling` (None if nothing)."""
    if not isinstance(sampling, dict):
        return f"sampling is {type(sampling).__name__}, not an object"
    for key, v in sampling.items():
        if key == "source":
            if not isinstance(v, str):
                return "sampling.source is not a string"
            continue
        if key not in SAMPLING_KEYS:
            return f"sampling.{key} is not one of {', '.join([*SAMPLING_KEYS, 'source'])}"
        kind, lo, hi, lo_open = SAMPLING_KEYS[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            return f"sampling.{key} is {type(v).__name__}, not {'an integer' if kind is int else 'a number'}"
        if not (lo < v if lo_open else lo <= v) or not v <= hi:  # NaN fails both
            return f"sampling.{key} = {v} is outside {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    return None


def defaults_of(manifest: dict, args=None) -> SamplingDefaults:
    """The sampling a bundle's requests get when they set none: the manifest's `sampling` (the
    model's, recorded at export, editable), each of `args`' --temperature/--top-p/--top-k/
    --repeat-penalty that is set (not None) over it; OpenAI's for a key neither gives. A manifest
    without `sampling` (an older export) gets UNRECORDED."""
    recorded = manifest.get("sampling")
    if recorded is None:
        base, source = dict(UNRECORDED), ("the bundle records no model defaults (an older export): greedy, as "
                                          "generate was; re-export it or add \"sampling\" to its edgekv.json")
    else:
        problem = check_sampling(recorded)
        if problem:
            raise BundleError(f"{MANIFEST}: corrupt manifest ({problem}; fix or remove its \"sampling\" object)")
        base = {k: v for k, v in recorded.items() if k in SAMPLING_KEYS}
        said = recorded.get("source") or "its manifest"
        source = f"the model's: {said}" if base else f"OpenAI's defaults: the model gives none ({said})"
    flags = {k: getattr(args, k) for k in SAMPLING_KEYS if getattr(args, k, None) is not None}
    if flags:
        source = f"{', '.join(f'{FLAGS[k]} {v:g}' for k, v in flags.items())} over {source}"
    values = {**base, **flags}
    return SamplingDefaults(temperature=float(values.get("temperature", 1.0)), top_p=float(values.get("top_p", 1.0)),
                            top_k=int(values.get("top_k", 0)), repeat_penalty=float(values.get("repeat_penalty", 1.0)),
                            source=source)


def penalized(logits: np.ndarray, p: SamplingParams, history: list[int]) -> np.ndarray:
    """The logits after the repetition penalty (the input itself when it is off)."""
    if p.repeat_penalty != 1.0 and history and p.repeat_last_n > 0:  # history[-0:] would be all of it
        logits = logits.copy()
        recent = np.unique(np.asarray(history[-p.repeat_last_n:], np.int64))
        vals = logits[recent]
        logits[recent] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    return logits


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator, history: list[int]) -> int:
    logits = penalized(logits, p, history)
    if not p.temperature >= GREEDY_BELOW:  # 0, too small for float32 (NaN too): greedy
        return int(np.argmax(logits))
    logits = np.asarray(logits)
    top = logits.max()  # NaN if any logit is
    if not np.isfinite(top):
        raise ValueError("cannot sample from non-finite logits")
    # in the logits' own precision (float32 from a graph), the max subtracted before dividing:
    # exact for close logits, and no overflow at a tiny temperature
    x = (logits - top) / p.temperature
    ids = None  # the candidates' token ids (None: every token)
    if p.top_k and p.top_k < x.shape[0]:
        ids = np.flatnonzero(x >= np.partition(x, -p.top_k)[-p.top_k])  # ties at the k-th all stay
        x = x[ids]
    w = np.exp(x)  # unnormalized probabilities (x <= 0, its max 0)
    if p.top_p < 1.0:
        keep = nucleus(w, p.top_p)
        ids, w = (keep if ids is None else ids[keep]), w[keep]
    i = draw(w, rng.random())
    return int(i if ids is None else ids[i])


BLOCK = 256


def draw(w: np.ndarray, u: float) -> int:
    """The index whose bin of the cumulative weights holds u · total (inverse CDF; one uniform,
    as Generator.choice(p=...) draws), in float64; never a zero weight. Block sums first, then a
    running sum through one block: a running sum over a whole vocabulary is slow
    (docs/benchmarks.md)."""
    n = w.shape[0]
    if n <= 4 * BLOCK:
        cdf = np.cumsum(w, dtype=np.float64)
        return inside(cdf, u * cdf[-1])
    blocks = np.pad(w, (0, -n % BLOCK)).reshape(-1, BLOCK)
    ends = np.cumsum(blocks.sum(axis=1, dtype=np.float64))
    target = u * ends[-1]
    b = min(int(np.searchsorted(ends, target, side="right")), ends.shape[0] - 1)
    return b * BLOCK + inside(np.cumsum(blocks[b], dtype=np.float64), target - (ends[b - 1] if b else 0.0))


def inside(cdf: np.ndarray, target: float) -> int:
    """The first bin of `cdf` ending above `target`, the target kept below the last bin's end (a
    sum rounded differently, or u · total rounded up, must not land past it on a zero weight)."""
    if not (np.isfinite(cdf[-1]) and cdf[-1] > 0):
        raise ValueError("sampling weights are not finite and positive (non-finite logits)")
    return int(np.searchsorted(cdf, min(max(target, 0.0), np.nextafter(cdf[-1], -np.inf)), side="right"))


def nucleus(w: np.ndarray, top_p: float) -> np.ndarray:
    """Indices of the smallest set of the largest weights whose share of the total is >= top_p.
    Sorts only the head: the m largest (argpartition, linear), m grown 4× until they hold top_p."""
    total = w.sum(dtype=np.float64)
    m = min(256, w.shape[0])
    while True:
        head = np.argpartition(w, -m)[-m:] if m < w.shape[0] else np.arange(w.shape[0])
        head = head[np.argsort(-w[head], kind="stable")]
        cum = np.cumsum(w[head], dtype=np.float64) / total
        if m == w.shape[0] or cum[-1] >= top_p:
            return head[: min(int(np.searchsorted(cum, top_p)) + 1, m)]
        m = min(4 * m, w.shape[0])


@dataclass
class TokenLogprob:
    """A sampled token's log-probability and the `top_n` most likely tokens (most likely first,
    ties by id) under the same distribution: see `distribution`."""
    token: int
    logprob: float
    top: list[tuple[int, float]]


def distribution(logits: np.ndarray, p: SamplingParams, history: list[int]) -> np.ndarray:
    """log-probabilities [V] (float64) of the distribution a token is sampled from: `logits` as
    the sampler gets them (a constraint's mask already applied: forbidden tokens -inf), after
    the repetition penalty, divided by the temperature (1 when greedy), before top-k/top-p cut
    it (the OpenAI API's logprobs are not renormalized over a nucleus either)."""
    x = penalized(logits, p, history).astype(np.float64)
    top = x.max()
    if not np.isfinite(top):
        raise ValueError("no log-probabilities from non-finite logits")
    x = (x - top) / (p.temperature if p.temperature >= GREEDY_BELOW else 1.0)
    return x - np.log(np.exp(x).sum())


def logprobs(logits: np.ndarray, p: SamplingParams, history: list[int], token: int, top_n: int = 0) -> TokenLogprob:
    """The sampled `token`'s log-probability and the top_n alternatives, from the same logits,
    params and history `sample` was given (call it next to `sample`, before the history grows)."""
    lp = distribution(logits, p, history)
    n = min(top_n, int(np.isfinite(lp).sum()))  # never a forbidden token among the alternatives
    top: list[tuple[int, float]] = []
    if n > 0:
        kth = np.partition(lp, -n)[-n]  # the n-th largest; of the tokens tied with it, the lowest ids
        above, tied = np.flatnonzero(lp > kth), np.flatnonzero(lp == kth)
        head = np.concatenate([above, tied[: n - above.shape[0]]])
        head = head[np.lexsort((head, -lp[head]))]  # most likely first, ties by id
        top = [(int(i), float(lp[i])) for i in head]
    return TokenLogprob(int(token), float(lp[token]), top)


def sampling_from(args, manifest: dict | None = None) -> SamplingParams:
    """The sampling of `edgekv generate` and `edgekv chat`: each flag left unset (None) is the
    bundle's default, as serve's requests get it (defaults_of)."""
    p = defaults_of(manifest or {}, args).params(seed=args.seed)
    p.repeat_last_n = args.repeat_last_n
    return p
