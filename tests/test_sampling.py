"""Sampling tested as a distribution: for fixed logits and a seeded generator, `sample()` draws from
exactly the support and with the frequencies its parameters define (temperature divides the
logits, top-k, top-p = the smallest set whose mass >= p, the repeat penalty inside its window);
and `--seed` reproduces a generation through the real CLI.

Frequency bound: with N draws, each token's count lies within 5 binomial standard deviations
(+1 for discreteness) of N * p. A correct sampler fails one bin with probability < 1e-5; the
wrong distributions the tests are meant to catch sit tens of sigmas away."""
import json

import numpy as np
import pytest

from edgekv.runtime.sampling import BLOCK, SamplingParams, sample
from edgekv.runtime.sampling import draw as inverse_cdf
from tests.conftest import cli, run_edgekv

N = 8000
LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)


def softmax(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def draw(logits, params: SamplingParams, history=(), n: int = N, seed: int = 0) -> np.ndarray:
    """Counts per token over n draws."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(logits), np.int64)
    for _ in range(n):
        counts[sample(logits, params, rng, list(history))] += 1
    return counts


def assert_frequencies(counts: np.ndarray, expected: np.ndarray) -> None:
    n = counts.sum()
    sigma = np.sqrt(n * expected * (1 - expected))
    dev = np.abs(counts - n * expected)
    assert (dev <= 5 * sigma + 1).all(), f"counts {counts.tolist()} vs expected {(n * expected).round(1).tolist()}"


def support(counts: np.ndarray) -> set[int]:
    return set(np.flatnonzero(counts).tolist())


# -- greedy and temperature -------------------------------------------------------------------

def test_greedy_is_argmax_and_uses_no_randomness():
    rng = np.random.default_rng(3)
    for _ in range(50):
        logits = rng.standard_normal(97).astype(np.float32) * 3
        assert sample(logits, SamplingParams(temperature=0.0), None, []) == int(np.argmax(logits))


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_temperature_divides_the_logits(t):
    counts = draw(LOGITS, SamplingParams(temperature=t))
    assert_frequencies(counts, softmax(LOGITS / t))


# -- top-k and top-p: exact support -----------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3])
def test_top_k_support_is_exactly_the_k_most_likely(k):
    counts = draw(LOGITS, SamplingParams(temperature=1.0, top_k=k))
    top = np.argsort(-LOGITS)[:k]
    assert support(counts) == set(top.tolist())
    p = np.zeros(len(LOGITS))
    p[top] = softmax(LOGITS[top])
    assert_frequencies(counts, p)


# probabilities 1/2, 1/4, 1/8, 1/16, 1/16: the cumulative masses 0.5 and 0.75 are exact in floating
# point (float64 logits: float32 ones would round the log-ratios and move the boundaries)
DYADIC = np.log(np.array([0.5, 0.25, 0.125, 0.0625, 0.0625]))


@pytest.mark.parametrize("top_p, kept", [
    (0.5, {0}),  # at a boundary: token 0 alone has mass 0.5 >= p
    (0.75 - 1e-6, {0, 1}),  # just below the next boundary
    (0.75, {0, 1}),  # at it: 0.5 + 0.25 >= 0.75 already, a third token is not needed
    (0.75 + 1e-6, {0, 1, 2}),  # just above it: two tokens are not enough
])
def test_top_p_keeps_the_smallest_set_with_mass_at_least_p(top_p, kept):
    p = softmax(DYADIC)
    cum = np.cumsum(p)
    assert cum[0] == 0.5 and cum[1] == 0.75  # the premise: the boundaries are exact
    counts = draw(DYADIC, SamplingParams(temperature=1.0, top_p=top_p), n=3000)
    assert support(counts) == kept
    q = np.zeros(len(p))
    idx = sorted(kept)
    q[idx] = p[idx] / p[idx].sum()
    assert_frequencies(counts, q)


# -- the repeat penalty -----------------------------------------------------------------------

def greedy(logits, history, penalty=1.5, last_n=64) -> int:
    p = SamplingParams(temperature=0.0, repeat_penalty=penalty, repeat_last_n=last_n)
    return sample(np.asarray(logits, np.float32), p, None, list(history))


def test_repeat_penalty_divides_a_positive_logit():
    logits = [2.0, 1.5, 0.0, -1.0]
    assert greedy(logits, [], penalty=1.5) == 0  # no history: nothing penalized
    assert greedy(logits, [0], penalty=1.5) == 1  # 2.0 / 1.5 = 1.33 < 1.5
    assert greedy(logits, [0], penalty=1.2) == 0  # 2.0 / 1.2 = 1.67 > 1.5
    assert greedy(logits, [0, 0, 0], penalty=1.2) == 0  # a token is penalized once, however often it appeared


def test_repeat_penalty_multiplies_a_negative_logit():
    """A negative logit is moved away from likely (-1.0 * 1.5 = -1.5), never raised toward zero."""
    logits = [-1.0, -1.2, -5.0, -6.0]
    assert greedy(logits, []) == 0
    assert greedy(logits, [0]) == 1  # -1.5 < -1.2
    assert greedy(logits, [0], penalty=1.1) == 0  # -1.1 > -1.2


@pytest.mark.parametrize("last_n", [8, 64])
def test_repeat_penalty_only_inside_its_window(last_n):
    logits = [2.0, 1.5, 0.0, -1.0]
    inside = [0] + [3] * (last_n - 1)  # token 0 is the oldest of the last `last_n`
    outside = [0] + [3] * last_n  # token 0 is one step older
    assert greedy(logits, inside, last_n=last_n) == 1
    assert greedy(logits, outside, last_n=last_n) == 0


def test_repeat_last_n_zero_switches_the_penalty_off():
    assert greedy([2.0, 1.5, 0.0, -1.0], [0], last_n=0) == 0


def test_repeat_penalty_distribution():
    history = [0, 4]  # one positive and one negative logit penalized
    counts = draw(LOGITS, SamplingParams(temperature=1.0, repeat_penalty=1.6), history)
    x = LOGITS.astype(np.float64).copy()
    x[0] /= 1.6
    x[4] *= 1.6
    assert_frequencies(counts, softmax(x))


def test_the_cli_passes_repeat_last_n():
    from edgekv.cli import build_parser
    from edgekv.runtime.sampling import sampling_from

    for cmd in (["generate", "b", "p"], ["chat", "b"]):
        args = build_parser().parse_args(cmd + ["--repeat-penalty", "1.3", "--repeat-last-n", "7"])
        p = sampling_from(args)
        assert (p.repeat_penalty, p.repeat_last_n) == (1.3, 7)


# -- --seed through the real CLI --------------------------------------------------------------

def generated_tokens(bundle, seed: int) -> list[int]:
    # temperature 4 on the tiny random model: its logits spread over a few units, so /4 leaves a
    # next-token distribution over hundreds of its 384 tokens; two different seeds then agree on
    # all 16 tokens with vanishing probability, while one seed must reproduce them exactly
    r = run_edgekv("generate", bundle, "The capital of France", "--raw", "--temperature", "4", "--seed", seed,
                   "--max-new-tokens", "16", "--json", "--threads", "1")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])["tokens"]


def test_seed_reproduces_through_the_cli(tiny_bundle_int8):
    a = generated_tokens(tiny_bundle_int8, 11)
    assert len(a) >= 4
    assert generated_tokens(tiny_bundle_int8, 11) == a
    assert generated_tokens(tiny_bundle_int8, 12) != a


# -- a real vocabulary: the block-wise inverse CDF and the partial sort of top-p -----------------

@pytest.mark.parametrize("n", [700, 5000, 49152])
def test_draw_is_the_inverse_cdf_at_every_bin(n):
    """Equal weights: u lands in bin floor(u * n), at the start, inside and at the end of every
    block of the running sum (the last one padded)."""
    w = np.ones(n, np.float32)
    bins = sorted({0, 1, BLOCK - 1, BLOCK, BLOCK + 1, n // 2, n - BLOCK - 1, n - 2, n - 1} & set(range(n)))
    for k in bins:
        for u in ((k + 1e-6) / n, (k + 0.5) / n, (k + 1 - 1e-6) / n):
            assert inverse_cdf(w, u) == k, (k, u)


def test_a_large_vocabulary_is_sampled_with_its_frequencies():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(49152).astype(np.float32) - 8  # a long, thin tail in every block
    hot = [0, 255, 256, 30000, 49151]
    logits[hot] = [2.0, 1.0, 0.5, 1.5, 0.0]
    counts = draw(logits, SamplingParams(temperature=1.0), n=4000)
    p = softmax(logits)
    assert_frequencies(np.r_[counts[hot], counts.sum() - counts[hot].sum()], np.r_[p[hot], 1 - p[hot].sum()])


@pytest.mark.parametrize("seed, scale, top_p", [(0, 3.0, 0.9), (1, 0.5, 0.9), (2, 6.0, 0.5), (3, 0.1, 0.99)])
def test_top_p_on_a_large_vocabulary_keeps_exactly_the_nucleus(seed, scale, top_p):
    """The nucleus from sorting only the head equals the one from sorting every token (peaked
    logits: a few tokens; flat ones: thousands, past the first head of 256)."""
    from edgekv.runtime.sampling import nucleus
    w = np.exp(np.random.default_rng(seed).standard_normal(49152) * scale).astype(np.float32)
    order = np.argsort(-w.astype(np.float64), kind="stable")
    cum = np.cumsum(w[order], dtype=np.float64) / w.sum(dtype=np.float64)
    want = order[: int(np.searchsorted(cum, top_p)) + 1]
    got = nucleus(w, top_p)
    assert set(got.tolist()) == set(want.tolist()) and len(got) == len(want)


# -- edge cases of the inverse CDF and the temperature ------------------------------------------

def test_draw_never_returns_a_zero_weight_index_at_a_block_end():
    """Block sums (pairwise) and the running sum inside a block (sequential) round differently:
    a u whose target lies between the two ends of a block ran off the block and was clamped to
    its last index, whatever that index's weight."""
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(50):
        n = 8 * BLOCK
        w = np.exp(rng.standard_normal(n) * 8 - 20).astype(np.float32)  # weights of many magnitudes
        w[BLOCK - 1:: BLOCK] = 0  # every block ends with a zero weight (a masked token)
        ends = np.cumsum(w.reshape(-1, BLOCK).sum(axis=1, dtype=np.float64))
        for b in range(len(ends)):
            inner_end = np.cumsum(w[b * BLOCK: (b + 1) * BLOCK], dtype=np.float64)[-1] + (ends[b - 1] if b else 0.0)
            if not inner_end < ends[b]:
                continue
            u = ends[b] / ends[-1]
            while u * ends[-1] >= ends[b]:
                u = np.nextafter(u, 0)
            if u * ends[-1] < inner_end:
                continue
            checked += 1
            i = inverse_cdf(w, float(u))
            assert w[i] > 0, f"drew index {i} (weight 0) at u={u!r}"
    assert checked


class FixedU:
    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_a_low_temperature_keeps_the_odds_of_close_logits():
    """Two logits one float32 ulp apart at temperature 1e-5: P(first) = 1 / (1 + e^0.19).
    Dividing float32 logits near 20 by 1e-5 rounds them to 0.125: P drifts by 1.5 points."""
    logits = np.array([20.0, np.nextafter(np.float32(20.0), np.float32(30.0))], np.float32)
    t = 1e-5
    x = logits.astype(np.float64) / t
    p0 = 1 / (1 + np.exp(x[1] - x[0]))
    lo, hi = 0.0, 1.0  # the u where the draw switches from token 0 to token 1 is P(token 0)
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sample(logits, SamplingParams(temperature=t), FixedU(mid), []) == 0 else (lo, mid)
    assert abs(lo - p0) < 1e-4, (lo, p0)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.9), (5, 0.9)])
def test_non_finite_logits_are_refused_not_sampled(top_k, top_p):
    """The engine and the Generator check first; a direct caller gets an error, never a token."""
    rng = np.random.default_rng(0)
    for bad in (np.nan, np.inf, -np.inf):
        for n in (6, 5000):
            logits = np.full(n, -np.inf if bad == -np.inf else 0.0, np.float32)
            logits[n // 2] = bad
            with pytest.raises(ValueError, match="non-finite"):
                sample(logits, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p), rng, [])


# -- temperatures too small for float32 ---------------------------------------------------------

@pytest.mark.parametrize("t", [1e-310, 5e-324, 1e-45, 1e-39, 1e-38])
def test_a_temperature_too_small_for_float32_is_greedy(t):
    """Below float32's smallest normal number the division overflows (or the temperature rounds
    to 0 and the max becomes 0 / 0 = NaN): the asked-for distribution is the argmax."""
    rng = np.random.default_rng(4)
    for _ in range(20):
        logits = rng.standard_normal(300).astype(np.float32) * 3
        for top_k, top_p in ((0, 1.0), (5, 0.9)):
            assert sample(logits, SamplingParams(temperature=t, top_k=top_k, top_p=top_p), rng, []) == np.argmax(logits)


def test_the_smallest_normal_temperature_still_samples():
    """At the threshold itself the division is finite: two exactly tied logits are both drawn
    (greedy would always take the first)."""
    from edgekv.runtime.sampling import GREEDY_BELOW
    logits = np.array([5.0, 5.0, -1.0], np.float32)
    counts = draw(logits, SamplingParams(temperature=GREEDY_BELOW), n=400)
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0


def test_generate_with_a_subnormal_temperature_is_greedy_through_the_cli(tiny_bundle_int8):
    def tokens(t):  # in this process (conftest's cli): what the command parses and samples, no new Python
        r = cli("generate", tiny_bundle_int8, "The capital of France", "--raw", "--temperature", t,
                       "--max-new-tokens", "8", "--json", "--threads", "1")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])["tokens"]

    assert tokens("1e-310") == tokens("0")


# -- logprobs: the distribution the token was sampled from ---------------------------------------

def oracle_logprobs(logits, temperature, penalty, last_n, history, forbidden=()) -> np.ndarray:
    """float64, written out plainly: the mask, the penalty per distinct recent token, the
    temperature (1 when greedy), log-softmax."""
    x = [float(v) for v in logits]
    for i in forbidden:
        x[i] = -np.inf
    for t in set(history[-last_n:] if last_n else []):
        x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    t = temperature if temperature > 0 else 1.0
    m = max(x)
    z = [(v - m) / t for v in x]
    lse = np.log(sum(np.exp(v) for v in z))
    return np.array([v - lse for v in z])


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.6])
def test_logprobs_are_the_log_softmax_the_sampler_saw(temperature):
    from edgekv.runtime.constraint import constrain
    from edgekv.runtime.sampling import logprobs

    rng = np.random.default_rng(7)
    for trial in range(10):
        logits = (rng.standard_normal(200) * 3).astype(np.float32)
        forbidden = rng.choice(200, 150, replace=False)
        history = rng.integers(0, 200, 40).tolist()

        class Mask:  # a constraint that forbids `forbidden`
            def allowed(self):
                ok = np.ones(200, bool)
                ok[forbidden] = False
                return ok

        seen = constrain(logits, Mask())  # what the sampler is handed
        p = SamplingParams(temperature=temperature, repeat_penalty=1.3, repeat_last_n=32)
        tok = sample(seen, p, rng, history)
        # the sampler penalizes in float32: the oracle, in float64, agrees to float32 rounding
        want = oracle_logprobs(logits, temperature, 1.3, 32, history, forbidden)
        got = logprobs(seen, p, history, tok, top_n=5)
        assert got.token == tok and got.logprob == pytest.approx(want[tok], abs=2e-6)
        order = sorted((i for i in range(200) if np.isfinite(want[i])), key=lambda i: (-want[i], i))
        assert [i for i, _ in got.top] == order[:5]
        assert [v for _, v in got.top] == pytest.approx([want[i] for i in order[:5]], abs=2e-6)
        assert not set(forbidden.tolist()) & {i for i, _ in got.top}


def test_top_logprobs_are_only_allowed_tokens_and_ties_go_by_id():
    from edgekv.runtime.sampling import logprobs

    logits = np.array([-np.inf, 1.0, 3.0, 1.0, -np.inf, 1.0], np.float32)
    got = logprobs(logits, SamplingParams(), [], 2, top_n=20)
    assert [i for i, _ in got.top] == [2, 1, 3, 5]  # four allowed, the three tied in id order
    assert [i for i, _ in logprobs(logits, SamplingParams(), [], 2, top_n=2).top] == [2, 1]
    assert logprobs(logits, SamplingParams(), [], 2).top == []


def test_logprobs_match_the_sampling_frequencies():
    """The distribution reported is the one drawn from (penalty and temperature, no top-k/top-p)."""
    from edgekv.runtime.sampling import distribution

    p = SamplingParams(temperature=0.8, repeat_penalty=1.5, repeat_last_n=8)
    history = [0, 3]
    counts = draw(LOGITS, p, history)
    assert_frequencies(counts, np.exp(distribution(LOGITS, p, history)))
