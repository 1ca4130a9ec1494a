"""engine/sampler.py: the batched draw against the distributions it must follow.

Each test draws many rows at once (one seed a row) from the same logits, so the
counts test the distribution, not one lucky draw: every token's count must sit within
5 standard deviations of its expected count, and no token outside the allowed set may
appear at all."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import sampler
from engine.backends.cuda import sampler as gpu_sampler
from engine.sampler import RowSampler, sample_batch
from engine.types import SamplingParams

N = 12000  # draws per test


ON_CUDA = mx.cuda.is_available()


@pytest.fixture(params=["numpy", "mlx"] + (["kernel"] if ON_CUDA else []))
def route(request, monkeypatch):
    """A test taking it runs on every route: the CPU's numpy draw, the MLX ops, and on
    a CUDA GPU engine/backends/cuda/sampler.py's kernel."""
    monkeypatch.setattr(sampler, "use_numpy_on_cpu", request.param == "numpy")
    monkeypatch.setattr(sampler, "use_kernel_on_gpu", request.param.startswith("kernel"))
    monkeypatch.setattr(gpu_sampler, "MIN_ROWS", 1)  # the kernel at every batch size
    return request.param


def rows_of(n: int, seed0: int = 0, **params) -> list[RowSampler]:
    return [RowSampler.from_params(SamplingParams(seed=seed0 + i, **params)) for i in range(n)]


def draw_counts(logits: np.ndarray, rows: list[RowSampler]) -> np.ndarray:
    batch = mx.broadcast_to(mx.array(logits[None].astype(np.float32)), (len(rows), len(logits)))
    tokens = np.array(sample_batch(batch, rows))
    return np.bincount(tokens, minlength=len(logits))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    """Counts within 5 sigma of N * probs per token; none where probs is 0."""
    n = counts.sum()
    expect = n * probs
    sigma = np.sqrt(np.maximum(expect * (1 - probs), 1.0))
    assert np.all(counts[probs == 0] == 0), np.nonzero(counts * (probs == 0))
    worst = np.max(np.abs(counts - expect) / sigma)
    assert worst < 5.0, worst


@pytest.mark.parametrize("vocab,temperature", [(600, 1.0), (1000, 0.5), (256, 2.0)])
def test_temperature_draw_follows_the_softmax(vocab, temperature, route):
    """Two-level draw (blocks of 256, the last padded) = softmax(logits / T)."""
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=vocab) * 2
    counts = draw_counts(logits, rows_of(N, temperature=temperature))
    assert_follows(counts, softmax(logits / temperature))


def test_top_k_keeps_the_k_largest_renormalized(route):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=800) * 1.5
    k = 40
    keep = np.argsort(-logits)[:k]
    probs = np.zeros_like(logits)
    probs[keep] = softmax(logits[keep])
    assert_follows(draw_counts(logits, rows_of(N, temperature=1.0, top_k=k)), probs)


def nucleus(logits: np.ndarray, top_p: float, top_k: int = 0) -> np.ndarray:
    """The draw's expected distribution: softmax over the ``top_k`` largest (all with
    0), then the fewest largest whose mass reaches ``top_p`` (``before < top_p``)."""
    p = softmax(logits)
    order = np.argsort(-p)[: top_k or len(p)]
    before = np.cumsum(p[order]) - p[order]
    kept = order[before < top_p]
    out = np.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


def test_top_p_is_the_exact_nucleus(route):
    """A peaked row: the nucleus lies inside the candidates."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=5000) * 3
    probs = nucleus(logits, 0.8)
    assert 0 < np.count_nonzero(probs) < sampler.CANDIDATES
    assert_follows(draw_counts(logits, rows_of(N, temperature=1.0, top_p=0.8)), probs)


def test_top_p_past_the_candidates_is_redone_over_the_whole_row(route):
    """A flat row: 90% of the mass needs ~2,700 of 3,000 tokens, far past the CPU's
    candidates; the draw must still be the exact nucleus: the excluded tail never
    drawn, tokens past the candidates drawn, and the counts in bins of 150 ranks within
    5 sigma (too few draws a token to test each alone)."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=3000) * 0.3
    probs = nucleus(logits, 0.9)
    assert np.count_nonzero(probs) > 2 * sampler.CANDIDATES
    counts = draw_counts(logits, rows_of(N, temperature=1.0, top_p=0.9))
    assert counts[probs == 0].sum() == 0
    order = np.argsort(-logits)
    assert counts[order[sampler.CANDIDATES :]].sum() > N // 4  # ~45% of the nucleus
    binned = counts[order].reshape(-1, 150).sum(axis=1)
    assert_follows(binned, probs[order].reshape(-1, 150).sum(axis=1))


def test_top_k_and_top_p_together(route):
    rng = np.random.default_rng(4)
    logits = rng.normal(size=700) * 2
    probs = nucleus(logits, 0.5, top_k=30)
    counts = draw_counts(logits, rows_of(N, temperature=1.0, top_k=30, top_p=0.5))
    assert_follows(counts, probs)


def test_masked_tokens_are_never_drawn(route):
    """-inf logits (a constrained-decoding mask) have weight exactly 0."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=512)
    logits[::3] = -np.inf
    counts = draw_counts(logits, rows_of(4000, temperature=1.5))
    assert counts[::3].sum() == 0
    assert_follows(counts, softmax(logits / 1.5))


def test_a_seeded_row_draws_the_same_in_any_batch(route):
    """Row seed 42's tokens over 6 steps, alone and in mixed batches (greedy rows,
    top-p rows, other seeds; at different positions), are the same."""
    rng = np.random.default_rng(6)
    steps = [rng.normal(size=(5, 3000)).astype(np.float32) * 2 for _ in range(6)]

    def run(make_batch, pos):
        rows = make_batch()
        got = []
        for logits in steps:
            batch = mx.array(logits[: len(rows)])
            batch[pos] = mx.array(logits[0])  # the row under test always sees row 0
            got.append(int(np.array(sample_batch(batch, rows))[pos]))
        return got

    def me():
        return RowSampler.from_params(SamplingParams(temperature=0.8, top_p=0.95, seed=42))

    alone = run(lambda: [me()], 0)
    mixed = run(
        lambda: [
            RowSampler.from_params(SamplingParams(temperature=0.0)),
            RowSampler.from_params(SamplingParams(temperature=1.0, seed=1)),
            me(),
            RowSampler.from_params(SamplingParams(temperature=1.0, top_p=0.5, seed=2)),
        ],
        2,
    )
    first = run(lambda: [me(), RowSampler.from_params(SamplingParams(temperature=0.7, seed=3))], 0)
    assert alone == mixed == first


def test_greedy_rows_take_the_argmax_beside_sampled_ones(route):
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(4, 900)).astype(np.float32)
    rows = [
        RowSampler.from_params(SamplingParams(temperature=0.0)),
        RowSampler.from_params(SamplingParams(temperature=1.0, seed=1)),
        RowSampler.from_params(SamplingParams(temperature=0.0)),
        RowSampler.from_params(SamplingParams(temperature=1.0, top_k=5, seed=2)),
    ]
    got = np.array(sample_batch(mx.array(logits), rows))
    assert got.dtype == np.int32 and got.shape == (4,)
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()
    assert got[3] in np.argsort(-logits[3])[:5]


def test_top_k_past_the_candidates_with_top_p(route):
    """top_k past CANDIDATES (the candidates grow to it) on a flat row with top-p
    0.95: the set is the nucleus of the top k, with no whole-row redo needed."""
    rng = np.random.default_rng(8)
    logits = rng.normal(size=3000) * 0.3
    k = sampler.CANDIDATES + 200
    probs = nucleus(logits, 0.95, top_k=k)
    assert np.count_nonzero(probs) == k  # the top-k set binds before the nucleus does
    counts = draw_counts(logits, rows_of(N, temperature=1.0, top_k=k, top_p=0.95))
    assert_follows(counts, probs)


@pytest.mark.parametrize("top_p,top_k", [(0.8, 0), (1.0, 20), (0.9, 300)])
def test_candidates_and_whole_rows_draw_the_same(top_p, top_k):
    """The CPU's numpy route sorts the candidates, a GPU's MLX route whole rows: with the
    same uniforms both (and numpy over whole rows) must draw the same token."""
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(600, 4000)).astype(np.float32) * 3
    rows = rows_of(600, temperature=0.9, top_p=top_p, top_k=top_k)
    u = np.array([r.draw() for r in rows], dtype=np.float32)
    inv_t = np.full((600, 1), 1 / 0.9, dtype=np.float32)
    cands = sampler._draw_filtered(logits, inv_t, u, rows, np)
    whole = sampler._draw_filtered(logits, inv_t, u, rows, np, full=True)
    ops = sampler._draw_filtered(mx.array(logits), mx.array(inv_t), mx.array(u), rows, mx)
    # (a float sum's order may move a boundary)
    assert (cands == whole).mean() > 0.998 and (cands == np.array(ops)).mean() > 0.998


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_kernel_and_mlx_ops_draw_the_same(dtype, monkeypatch):
    """engine/backends/cuda/sampler.py's kernel against the MLX ops for the same uniforms, the
    llama-3 vocabulary, sampled rows beside greedy ones: the same tokens but where a
    float sum's order moves a boundary."""
    rng = np.random.default_rng(7)
    b, v = 64, 128256
    logits = mx.array((rng.normal(size=(b, v)) * 3).astype(np.float32)).astype(dtype)
    logits[5, 1000:1003] = 40.0  # a tie: the first index, as mx.argmax

    def tokens(kernel: bool) -> np.ndarray:
        monkeypatch.setattr(sampler, "use_kernel_on_gpu", kernel)
        rows = rows_of(b, seed0=50, temperature=0.8)
        for i in (0, 5, 17):
            rows[i] = RowSampler.from_params(SamplingParams(temperature=0.0))
        return np.array(sample_batch(logits, rows))

    ops, kern = tokens(False), tokens(True)
    assert kern.shape == (b,) and kern.dtype == np.int32
    assert kern[5] == 1000 and kern[0] == int(np.argmax(np.array(logits[0].astype(mx.float32))))
    assert (ops == kern).mean() >= 0.95, (ops != kern).sum()


# --------------------------------------------------------------------------- adjustments


def adjusted(logits, prompt, generated, p: SamplingParams, end_ids=()) -> np.ndarray:
    """engine/penalties.py's adjustments written out for one row, in float64:
    min_tokens, logit_bias, repetition, frequency / presence, min_p."""
    x = logits.astype(np.float64).copy()
    if len(generated) < p.min_tokens:
        x[list(end_ids)] = -np.inf
    for t, v in p.logit_bias:
        x[t] += v
    counts = np.bincount(np.array(generated, dtype=np.int64), minlength=len(x))[: len(x)]
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[list(prompt)] = True
        x = np.where(seen, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    x = x - counts * p.frequency_penalty - (counts > 0) * p.presence_penalty
    if p.min_p > 0 and p.temperature > 0:
        x = np.where((x - x.max()) / p.temperature < np.log(p.min_p), -np.inf, x)
    return x


PENALIZED = [
    SamplingParams(temperature=0.0, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(
        temperature=0.0,
        frequency_penalty=-0.3,
        presence_penalty=0.4,
        repetition_penalty=1.2,
        logit_bias=((3, 2.5), (10, -100.0)),
    ),
    SamplingParams(temperature=0.0),  # no adjustment, between adjusted rows
    SamplingParams(temperature=0.0, logit_bias=((7, 100.0),)),
    SamplingParams(temperature=0.0, min_tokens=4),
]


def test_penalties_follow_their_definitions_in_a_mixed_batch(route):
    """Greedy rows with each kind of adjustment (and one without) over 12 steps of
    peaked random logits that make repeats likely: every row's token is the argmax of
    its own adjusted logits (the float64 reference above), step after step, while
    the batch's other rows adjust differently."""
    rng = np.random.default_rng(11)
    v, steps = 40, 12
    prompts = [list(rng.integers(0, v, size=6)) for _ in PENALIZED]
    end = (5,)
    rows = [RowSampler.from_params(p, prompt, end) for p, prompt in zip(PENALIZED, prompts)]
    generated = [[] for _ in rows]
    for _ in range(steps):
        logits = (rng.normal(size=(len(rows), v)) * 1.5).astype(np.float32)
        logits[:, 5] += 3.0  # the end token tempts every row
        logits[:, :4] += 2.0  # a few favourites: repeats without penalties
        before = logits.copy()
        got = np.array(sample_batch(mx.array(logits), rows))
        assert np.array_equal(logits, before)  # the caller's logits are not changed
        for i, p in enumerate(PENALIZED):
            want = adjusted(logits[i], prompts[i], generated[i], p, end)
            assert got[i] == int(np.argmax(want)), (i, got[i], np.argsort(-want)[:3])
            generated[i].append(int(got[i]))
    assert 5 not in generated[6][:4] and generated[6][4:].count(5) > 0  # min_tokens 4
    assert 10 not in generated[3] and generated[5].count(7) == steps  # bias -100, +100
    assert len(set(generated[0])) > len(set(generated[4]))  # penalties spread the tokens


def test_min_p_draws_from_the_kept_tokens(route):
    """min_p 0.1 at temperature 0.8: tokens under a tenth of the top one's
    probability (at that temperature) are never drawn, the rest follow the softmax
    renormalised over them."""
    rng = np.random.default_rng(12)
    logits = rng.normal(size=300) * 2
    t, min_p = 0.8, 0.1
    probs = softmax(logits / t)
    probs[probs < min_p * probs.max()] = 0
    probs /= probs.sum()
    assert 3 < np.count_nonzero(probs) < 100
    rows = rows_of(N // 2, temperature=t, min_p=min_p)
    assert_follows(draw_counts(logits, rows), probs)


def test_adjusted_seeded_rows_draw_the_same_in_any_batch(route):
    """A seeded row with penalties and a bias draws the same tokens alone and in a
    mixed batch (greedy rows, other penalized rows, at another position)."""
    rng = np.random.default_rng(13)
    steps = [rng.normal(size=(4, 500)).astype(np.float32) * 2 for _ in range(8)]
    params = SamplingParams(
        temperature=0.9,
        seed=5,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        repetition_penalty=1.3,
        logit_bias=((4, 1.0),),
        min_p=0.02,
        min_tokens=2,
    )

    def run(others, pos):
        rows = [RowSampler.from_params(p, [1, 2, 3], (0,)) for p in others]
        rows.insert(pos, RowSampler.from_params(params, [1, 2, 3], (0,)))
        got = []
        for logits in steps:
            batch = mx.array(logits[: len(rows)])
            batch[pos] = mx.array(logits[0])
            got.append(int(np.array(sample_batch(batch, rows))[pos]))
        return got

    alone = run([], 0)
    mixed = run(
        [
            SamplingParams(temperature=0.0, presence_penalty=2.0),
            SamplingParams(temperature=1.0, seed=1),
            SamplingParams(temperature=0.7, top_p=0.8, seed=2, repetition_penalty=2.0),
        ],
        2,
    )
    assert alone == mixed


def test_neutral_values_adjust_nothing():
    """Every adjustment at its neutral value: no per-row state, and the sampler never
    copies the logits for it (``penalties.plan`` is None)."""
    neutral = SamplingParams(
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repetition_penalty=1.0,
        min_p=0.0,
        min_tokens=0,
        logit_bias=(),
    )
    rows = [RowSampler.from_params(neutral, [1, 2], (0,)) for _ in range(3)]
    assert all(r.adjust is None for r in rows)
    assert sampler.penalties.plan(rows) is None
    greedy_min_p = SamplingParams(temperature=0.0, min_p=0.5)  # min_p moves no argmax
    assert RowSampler.from_params(greedy_min_p).adjust is None
