"""Constrained decoding in the engine: grammars, masks and the batched sampler.

The grammar engine (llguidance) is real; the models are a tiny random llama with a
byte-level vocabulary (every output is a byte string, so a grammar's effect is plain to
see) driven through EngineClient, sync and pipelined (the GPU's order of work, run on
the CPU here).
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from engine.client import EngineClient
from engine.config import EngineConfig
from engine.loading import build_random_model
from engine.sampler import RowSampler, sample_batch
from engine.structured import (
    FORWARD_FIRST,
    READ_FIRST,
    GrammarCompiler,
    MaskFiller,
    StepOrder,
    apply_token_masks,
)
from engine.tokenizer import Tokenizer
from engine.types import (
    FinishReason,
    GenerationRequest,
    GrammarError,
    GrammarSpec,
    SamplingParams,
)
from tests.helpers.models import RANDOM_LLAMA

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green"]},
        "xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["id", "tag", "xs"],
    "additionalProperties": False,
}


def spec(kind: str, source) -> GrammarSpec:
    return GrammarSpec(kind, source if isinstance(source, str) else json.dumps(source))


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(Tokenizer.byte_level(258), 258)


# -- compiling ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, source, words",
    [
        ("json_schema", {"type": "object", "properties": {"a": {"not": {}}}}, ["not"]),
        ("json_schema", {"type": "string", "format": "credit-card"}, ["credit-card"]),
        ("json_schema", {"type": "string", "pattern": "(?=a)b"}, ["look-around"]),
        ("regex", "a(b", ["regex"]),
        ("lark", "start: missing_rule", ["missing_rule"]),
        ("choice", [], ["non-empty"]),
        ("json_schema", "[1, 2]", ["object"]),
    ],
)
def test_refused_grammars_name_what(compiler, kind, source, words):
    with pytest.raises(GrammarError) as err:
        compiler.compile(spec(kind, source))
    for w in words:
        assert w in str(err.value), str(err.value)


def test_compiled_grammars_are_cached_and_copied(compiler):
    s = spec("json_schema", SCHEMA)
    first = compiler.compile(s)
    assert compiler.compile(spec("json_schema", SCHEMA)) is first  # equal specs: one compile
    a, b = compiler.matcher(s), compiler.matcher(s)
    assert a.accept(ord("{")) and not b.matcher.is_error()
    # b is untouched by a: it still refuses what only a's state allows
    assert b.accept(ord("{")) and a.accept(ord('"'))


# -- masks ----------------------------------------------------------------------------------


def _allowed(logits: mx.array) -> np.ndarray:
    return np.isfinite(np.array(logits))


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "mlx"])
def test_masks_touch_only_constrained_rows(compiler, on_host):
    s = spec("regex", "ab+")
    filler = MaskFiller(258, eos_ids=[257])
    g1, g2 = compiler.matcher(s), compiler.matcher(s)
    assert g2.accept(ord("a"))
    masks = filler.fill([(0, g1), (2, g2)])  # rows 0 and 2 of 3
    logits = mx.array(np.random.default_rng(0).normal(size=(3, 258)).astype(np.float32))
    out = _allowed(apply_token_masks(logits, masks, on_host=on_host))
    assert set(np.flatnonzero(out[0])) == {ord("a")}
    assert out[1].all()  # unconstrained row: untouched
    assert set(np.flatnonzero(out[2])) == {ord("b")}
    np.testing.assert_array_equal(
        np.array(logits)[1], np.array(apply_token_masks(logits, masks, on_host))[1]
    )


def test_device_masks_apply_on_another_thread(compiler):
    """The device route runs on the engine's worker thread, not the importing one:
    MLX evaluates an array only on the thread whose stream made it, so nothing it
    uses may be made at import (a module-level ``mx.arange`` failed every
    constrained prefill on a GPU with "There is no Stream(gpu, 0) in current thread")."""
    import threading

    filler = MaskFiller(258, eos_ids=[257])
    masks = filler.fill([(0, compiler.matcher(spec("regex", "ab+")))])
    out: list = []

    def worker():
        try:
            logits = mx.zeros((1, 258))
            out.append(np.array(apply_token_masks(logits, masks, on_host=False)))
        except Exception as exc:  # noqa: BLE001 - reported below
            out.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not isinstance(out[0], Exception), out[0]
    assert set(np.flatnonzero(np.isfinite(out[0][0]))) == {ord("a")}


def test_a_grammar_in_error_leaves_only_eos(compiler):
    g = compiler.matcher(spec("regex", "ab"))
    assert not g.accept(ord("z"))  # refused: the matcher is in error from now on
    assert g.error
    masks = MaskFiller(258, eos_ids=[257]).fill([(0, g)])
    out = _allowed(apply_token_masks(mx.zeros((1, 258)), masks, on_host=True))
    assert set(np.flatnonzero(out[0])) == {257}


def test_sampler_draws_only_allowed_tokens(compiler):
    """Greedy, temperature and top-p rows, masked or not, in one batch."""
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(size=(4, 258)).astype(np.float32) * 3)
    rows = [
        RowSampler.from_params(SamplingParams(temperature=0.0)),
        RowSampler.from_params(SamplingParams(temperature=1.0, seed=3)),
        RowSampler.from_params(SamplingParams(temperature=0.9, top_p=0.8, seed=4)),
        RowSampler.from_params(SamplingParams(temperature=0.0)),
    ]
    s = spec("regex", "[xyz]")
    filler = MaskFiller(258, eos_ids=[257])
    for _ in range(20):
        masks = filler.fill([(i, compiler.matcher(s)) for i in range(3)])
        tokens = np.array(sample_batch(logits, rows, masks)).tolist()
        assert all(chr(t) in "xyz" for t in tokens[:3]), tokens
        assert tokens[3] == int(np.argmax(np.array(logits)[3]))  # unmasked row: its own argmax


def _orders_run(order: StepOrder, cost: dict, steps: int, batch=lambda i: 8) -> str:
    """The orders ``order`` picks over ``steps`` steps that take ``cost[order]`` seconds."""
    now, picked = 0.0, []
    for i in range(steps):
        o = order.next(batch(i), now)
        picked.append("f" if o == FORWARD_FIRST else "r")
        now += cost[o]
    return "".join(picked)


def test_step_order_keeps_the_faster_order_and_probes_again():
    order = StepOrder(probe_steps=4, keep_steps=10)
    run = _orders_run(order, {READ_FIRST: 3.0, FORWARD_FIRST: 2.0}, 20)
    assert run == "fffff" + "rrrrr" + "f" * 10  # probe both, keep the faster
    assert order.chosen == FORWARD_FIRST
    run = _orders_run(order, {READ_FIRST: 1.0, FORWARD_FIRST: 2.0}, 25)
    assert run == "rrrrr" + "fffff" + "r" * 10 + "fffff"  # the next probe finds the other
    assert order.chosen == READ_FIRST


def test_step_order_counts_no_period_across_a_batch_size_change():
    # the batch grows at every step of the probe: no period is comparable, the choice stays
    order = StepOrder(probe_steps=4, keep_steps=10)
    _orders_run(order, {READ_FIRST: 3.0, FORWARD_FIRST: 1.0}, 11, batch=lambda i: i)
    assert order.chosen == READ_FIRST
    assert StepOrder(fixed=FORWARD_FIRST).next(8, 0.0) == FORWARD_FIRST


# -- through the engine ---------------------------------------------------------------------


# the pipelined constrained step in each of its orders, and switching between them as
# its timing does (every few steps here: engine/structured/step_order.py)
ORDERS = {
    "sync": None,
    "pipelined-read-first": StepOrder(fixed=READ_FIRST),
    "pipelined-forward-first": StepOrder(fixed=FORWARD_FIRST),
    "pipelined-timed": StepOrder(probe_steps=2, keep_steps=3),
}


@pytest.fixture(scope="module", params=list(ORDERS), ids=list(ORDERS))
def tiny(request):
    loaded = build_random_model("llama", {**RANDOM_LLAMA, "vocab_size": 258}, seed=1)
    order = ORDERS[request.param]
    client = EngineClient.from_loaded(
        [(loaded, None)],
        EngineConfig(max_num_seqs=8, prefill_chunk_tokens=16, pipeline_decode=order is not None),
    )
    if order is not None:
        client.worker(loaded.name).step_order = order
    yield loaded.name, client
    client.shutdown()


_ids = iter(range(10**9))


async def _run(client, model, prompt, grammar=None, **params):
    params = {"max_tokens": 48, "temperature": 0.0, **params}
    req = GenerationRequest(
        f"s{next(_ids)}", model, list(prompt), SamplingParams(**params), grammar=grammar
    )
    text, tokens, last = "", [], None
    async for ev in client.generate(req):
        text += ev.text
        tokens += ev.token_ids
        last = ev
    return text, tokens, last


PROMPT = [72, 105, 33, 10, 65, 66, 67]


def test_constrained_rows_in_a_mixed_batch(tiny):
    """Constrained rows follow their grammars; the unconstrained rows of the same batch
    give the tokens they give alone (greedy)."""
    model, client = tiny
    grammars = [
        spec("json_schema", SCHEMA),
        spec("regex", "[a-c]{3,6}!"),
        spec("choice", ["alpha", "beta", "gamma"]),
        spec("lark", 'start: "<" NUM ("," NUM)* ">"\nNUM: /[0-9]{1,3}/'),
    ]

    async def main():
        free_alone = await _run(client, model, PROMPT, ignore_eos=True, max_tokens=20)
        runs = [
            _run(client, model, PROMPT, g, temperature=t, seed=i)
            for i, g in enumerate(grammars)
            for t in (0.0, 1.0)
        ]
        runs.append(_run(client, model, PROMPT, ignore_eos=True, max_tokens=20))
        return free_alone, await asyncio.gather(*runs)

    free_alone, results = asyncio.run(main())
    *constrained, free = results
    assert free[1] == free_alone[1]
    for i, (text, _, last) in enumerate(constrained):
        kind = grammars[i // 2].kind
        assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), last
        if last.finish_reason is FinishReason.LENGTH:
            continue  # a cut-short answer is checked in the next test
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch("[a-c]{3,6}!", text), text
        elif kind == "choice":
            assert text in ("alpha", "beta", "gamma")
        else:
            assert re.fullmatch(r"<[0-9]{1,3}(,[0-9]{1,3})*>", text), text
    # the short grammars always complete in 48 tokens
    assert all(r[2].finish_reason is FinishReason.STOP for r in constrained[2:6])


def test_cut_short_output_is_a_valid_prefix(tiny, compiler):
    model, client = tiny
    s = spec("json_schema", {"type": "array", "items": {"type": "string"}, "minItems": 50})
    text, tokens, last = asyncio.run(
        _run(client, model, PROMPT, s, max_tokens=12, temperature=1.0, seed=7)
    )
    assert last.finish_reason is FinishReason.LENGTH and len(tokens) == 12
    checker = compiler.matcher(s)
    assert all(checker.accept(t) for t in tokens), (text, checker.error)
    assert text.startswith("[")


def test_a_grammar_that_compiles_badly_ends_only_its_request(tiny):
    """The HTTP layer checks grammars first; a request that skips that and carries a
    broken one ends with an error while the rest of the batch goes on."""
    model, client = tiny

    async def main():
        return await asyncio.gather(
            _run(client, model, PROMPT, spec("regex", "a(")),
            _run(client, model, PROMPT, ignore_eos=True, max_tokens=8),
            return_exceptions=True,
        )

    bad, good = asyncio.run(main())
    assert isinstance(bad, Exception) or bad[2].finish_reason is FinishReason.ERROR
    assert good[2].finish_reason is FinishReason.LENGTH and len(good[1]) == 8


def test_constrained_rows_keep_their_logprobs(tiny):
    """A constrained row that asks for logprobs gets one per token with its top 2,
    sync and pipelined (the pipelined constrained step hands them on like any other)."""
    model, client = tiny
    got, tokens, text = [], [], ""

    async def collect():
        nonlocal text
        req = GenerationRequest(
            f"s{next(_ids)}",
            model,
            list(PROMPT),
            SamplingParams(max_tokens=10, temperature=0.0, logprobs=2),
            grammar=spec("regex", "[a-c]{3,6}!"),
        )
        async for ev in client.generate(req):
            text += ev.text
            tokens.extend(ev.token_ids)
            got.extend(ev.logprobs or ())

    asyncio.run(collect())
    assert re.fullmatch("[a-c]{3,6}!", text), text
    assert len(got) == len(tokens) > 0
    assert all(len(lp.top) == 2 and lp.logprob <= 0.0 for lp in got)


def test_a_token_fed_ahead_is_not_fed_twice(compiler):
    """The pipelined step feeds a grammar before filling its next mask (``feed_ahead``)
    and hands the token on after; that later ``accept`` of the same token takes the
    answer instead of advancing the grammar again, and a different token is an error,
    not a silent double feed."""
    s = spec("regex", "ab!")
    g = compiler.matcher(s)
    g.feed_ahead(ord("a"))
    assert g.accept(ord("a"))
    assert g.accept(ord("b")) and g.accept(ord("!")) and g.done
    g = compiler.matcher(s)
    g.feed_ahead(ord("x"))  # refused: the answer is kept for accept
    assert not g.accept(ord("x")) and g.error
    g = compiler.matcher(s)
    g.feed_ahead(ord("a"))
    with pytest.raises(RuntimeError, match="ahead"):
        g.accept(ord("b"))
    # the hand-on runs while the next mask is filled: accept and done after a feed
    # ahead answer from what it kept, never from the matcher the fill is using
    g = compiler.matcher(s)
    g.accept(ord("a"))
    g.accept(ord("b"))
    g.feed_ahead(ord("!"))
    matcher, g.matcher = g.matcher, None
    assert g.accept(ord("!")) and g.done
    g.matcher = matcher
    assert not compiler.matcher(s).done


def test_a_failing_mask_fill_ends_only_the_constrained_rows(tiny, monkeypatch):
    """If llguidance's fill fails mid-answer, the constrained rows end with an error and
    the unconstrained row of the same batch runs to its length, sync and pipelined
    (where the fill runs while the forward is queued, after the grammars were fed)."""
    model, client = tiny
    masks = client.worker(model).masks
    real, calls = masks.fill, [0]

    def failing(rows):
        calls[0] += 1
        if calls[0] > 3:
            raise RuntimeError("fill broke")
        return real(rows)

    monkeypatch.setattr(masks, "fill", failing)

    async def main():
        return await asyncio.gather(
            _run(client, model, PROMPT, spec("regex", "[a-c]{40}"), max_tokens=30),
            _run(client, model, PROMPT, ignore_eos=True, max_tokens=12),
        )

    bad, good = asyncio.run(main())
    assert bad[2].finish_reason is FinishReason.ERROR, bad[2]
    assert "fill broke" in (bad[2].error or ""), bad[2]
    assert 0 < len(bad[1]) < 30 and re.fullmatch("[a-c]*", bad[0]), bad[0]
    assert good[2].finish_reason is FinishReason.LENGTH and len(good[1]) == 12
