"""The engine's cache kinds (engine/cache_layout.py) one by one: what a model's
``make_cache()`` maps to, sliding windows dropping old keys in the running batch,
what the prefix cache can reuse for each kind (and why not elsewhere), and the KV
budget each layout counts."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from engine.cache_layout import ATTENTION, STATE, WINDOW, CacheLayout, LeafSpec
from engine.client import EngineClient
from engine.config import EngineConfig
from engine.kv import KVRows
from engine.loading import ModelLoadError, build_random_model
from engine.model import attention
from engine.prefix_cache import PrefixCache
from engine.runner import ModelRunner
from engine.state_cache import StateRows
from engine.types import GenerationRequest, SamplingParams
from tests.helpers.families import tiny_config


def reference(model, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    with attention.original():
        steps = generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=n)
        return [int(t) for t, _ in steps]


def test_layouts_follow_make_cache() -> None:
    cases = {
        "llama": "2 x attention",
        "gemma3_text": "1 x window(8), 1 x attention",
        # 4 layers, the last two reuse the first two's K/V: two cache entries
        "gemma4_text": "1 x window(8), 1 x attention",
        "qwen3_next": "2 x state(2), 2 x attention",
        "falcon_h1": "2 x state(2), 2 x attention",  # a CacheList of both in each layer
    }
    for family, want in cases.items():
        loaded = build_random_model(family, tiny_config(family))
        layout = CacheLayout.of(loaded.model, family)
        assert layout.describe() == want, family
    assert CacheLayout.of(build_random_model("llama", tiny_config("llama")).model, "llama").plain


def test_unknown_cache_class_is_refused_at_load() -> None:
    loaded = build_random_model("llama4", tiny_config("llama4"))
    with pytest.raises(
        ModelLoadError, match="model family 'llama4' is not supported.*ChunkedKVCache"
    ):
        ModelRunner(loaded.model)


def test_window_rows_drop_old_keys_and_match_mlx_lm() -> None:
    """A window-4 layer in a batch of rows that join at different steps: each row's
    greedy tokens are mlx-lm's, while the batch holds about two windows of keys."""
    cfg = dict(tiny_config("gemma3_text"), sliding_window=4)
    loaded = build_random_model("gemma3_text", cfg, seed=4)
    runner = ModelRunner(loaded.model, fused_decode=False)
    prompts = [list(range(1, 12)), [7, 8], list(range(30, 60))]
    n = 30
    want = [reference(loaded.model, p, n) for p in prompts]
    batch = runner.new_batch_kv()
    window = next(leaf for leaf in batch.leaves if leaf.window is not None)
    got: list[list[int]] = [[] for _ in prompts]
    rows: list[int] = []
    longest = 0
    for step in range(n + 10):
        if step in (0, 3, 10) and len(rows) < len(prompts):  # rows join mid-batch
            i = len(rows)
            kv = runner.new_sequence_kv()
            logits = runner.prefill(kv, prompts[i], want_logits=True)
            got[i].append(int(mx.argmax(logits).item()))
            batch.add(kv.rows())
            rows.append(i)
        live = [i for i in rows if len(got[i]) < n]
        if not live:
            break
        keep = [rows.index(i) for i in live]
        if len(keep) < len(rows):  # rows leave as they finish
            batch.keep(keep)
            rows = live
        logits = runner.decode(batch, [got[i][-1] for i in rows])
        for r, i in enumerate(rows):
            got[i].append(int(mx.argmax(logits[r]).item()))
        longest = max(longest, window.length)
    assert got == want
    assert max(window.base) > 0, "the window layer never dropped a key"
    assert longest <= 4 + 16 + 1, longest  # window - 1 kept, compaction at 16 dead steps


def _layout() -> CacheLayout:
    layout = CacheLayout(
        "test",
        [LeafSpec(ATTENTION), LeafSpec(WINDOW, window=8), LeafSpec(STATE, slots=1)],
        [0, 1, 2],
    )
    layout.leaf_bytes = [8, 8, 64]  # bytes per position (KV), per sequence (state)
    return layout


def _kv(start: int, end: int) -> KVRows:
    """Positions [start, end) of a leaf whose key at position p is p."""
    keys = mx.arange(start, end, dtype=mx.float32).reshape(1, 1, end - start, 1)
    return KVRows(keys, keys, start)


def test_prefix_reuse_per_kind() -> None:
    """Attention leaves continue at any block end; window leaves need only the blocks
    covering the window before it; state leaves only where a state was kept (the
    prompt's last block end), so a prompt sharing a shorter start reuses nothing."""
    cache = PrefixCache(10_000, block=16, layout=_layout())
    tokens = list(range(100, 148))  # 48 tokens: 3 blocks
    state = StateRows((mx.ones((1, 4)),))
    cache.insert(tokens, [_kv(0, 48), _kv(0, 48), None], state=(32, [None, None, state]))

    matched, rows = cache.lookup(tokens + [1])  # a longer prompt: back to the kept state
    assert matched == 32
    attn, win, st = rows
    assert attn.base == 0 and attn.end == 32
    assert win.base == 16 and win.end == 32  # blocks covering positions 25..31 only
    np.testing.assert_array_equal(np.array(win.keys).ravel(), np.arange(16, 32))
    assert st is state

    assert cache.lookup(tokens[:40] + [7, 7])[0] == 32
    # shares 20 tokens: a block end at 16 exists, but no state was kept there
    assert cache.lookup(tokens[:20] + [7] * 20) == (0, None)


def test_attention_reuses_the_next_blocks_shared_start() -> None:
    """Full attention only: after the matching blocks, the shared start of a stored
    next block is reused too (any child, the longest run), always leaving the
    prompt's last token to compute; a layout with window or state leaves stops at
    block ends."""
    plain = CacheLayout("llama", [LeafSpec(ATTENTION)] * 2, [0, 1])
    cache = PrefixCache(10_000, block=16, layout=plain)
    system = list(range(100, 121))  # 21 tokens: a block and 5 into the next
    cache.insert(system + [1] * 27, [_kv(0, 48), _kv(0, 48)])
    cache.insert(system + [2] * 27, [_kv(0, 48), _kv(0, 48)])
    matched, rows = cache.lookup(system + [3] * 30)
    assert matched == 21
    for r in rows:
        assert r.base == 0 and r.end == 21
        np.testing.assert_array_equal(np.array(r.keys).ravel(), np.arange(21))
    assert cache.lookup(system[:7] + [9] * 10)[0] == 7  # inside the first block
    assert cache.lookup(system[:7] + [1])[0] == 7  # the last token is never taken
    assert cache.lookup(system[:7])[0] == 6
    assert cache.lookup([5] * 20) == (0, None)
    assert cache.hit_tokens == 21 + 7 + 7 + 6

    mixed = PrefixCache(10_000, block=16, layout=_layout())
    mixed.insert(system + [1] * 27, [_kv(0, 48), _kv(0, 48), None])
    assert mixed.lookup(system + [3] * 30) == (0, None)  # no state kept: nothing


def test_window_blocks_of_a_finished_row() -> None:
    """A finished row of the batch holds only its last window: blocks before it are
    not stored, and a lookup stops where the window leaf cannot continue."""
    layout = _layout()
    layout.leaves = layout.leaves[:2]
    layout.groups = [0, 1]
    layout.leaf_bytes = [8, 8]
    cache = PrefixCache(10_000, block=16, layout=layout)
    tokens = list(range(64))
    cache.insert(tokens, [_kv(0, 64), _kv(40, 64)])  # the window leaf from position 40
    matched, rows = cache.lookup(tokens + [1])  # at 64 it needs 57..63: block 3, held
    assert matched == 64 and rows[1].base == 48
    # at 48 it needs 41..47: the row held them, but not all of block 2 (32..47), which
    # was not stored; no shorter block end has its window either
    assert cache.lookup(tokens[:48] + [1]) == (0, None)


def test_prefix_cache_counts_budget_tokens_per_layout() -> None:
    layout = _layout()
    assert layout.unit_bytes == 16  # a position in both KV leaves
    cache = PrefixCache(10_000, block=16, layout=layout)
    tokens = list(range(32))
    state = StateRows((mx.ones((1, 16)),))  # 64 bytes: 4 budget tokens
    cache.insert(tokens, [_kv(0, 32), _kv(0, 32), None], state=(32, [None, None, state]))
    assert cache.tokens_held == 16 + 16 + 4
    small = PrefixCache(20, block=16, layout=layout)
    small.insert(tokens, [_kv(0, 32), _kv(0, 32), None], state=(32, [None, None, state]))
    assert small.tokens_held <= 20  # the leaf block went


def test_kv_budget_per_layout() -> None:
    """A sequence's KV budget: one token a position for full attention; a window layer
    holds at most its prompt, then about two windows; a state layer a fixed size."""
    layout = _layout()
    layout.leaf_bytes = [8, 8, 16]
    # attention 8 * 100 + window 8 * max(prompt 10, 8 + 16) + state 16, in 16-byte units
    assert layout.kv_tokens(10, 100) == (800 + 8 * 24 + 16 + 15) // 16
    assert layout.kv_tokens(200, 300) == (2400 + 8 * 200 + 16 + 15) // 16
    plain = CacheLayout("llama", [LeafSpec(ATTENTION)] * 2, [0, 1])
    assert plain.kv_tokens(10, 100) == 100


def _run(client, model: str, prompt: list[int], n: int = 8):
    async def go():
        req = GenerationRequest(
            request_id=f"k{len(prompt)}-{prompt[-1]}",
            model=model,
            prompt_tokens=prompt,
            params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        )
        out, last = [], None
        async for ev in client.generate(req):
            out.extend(ev.token_ids)
            last = ev
        return out, last.cached_tokens

    return asyncio.run(go())


@pytest.mark.parametrize("family,shorter", [("qwen3_next", 0), ("llama", 20)])
def test_state_layers_reuse_only_kept_states(family, shorter) -> None:
    """Through the engine: a prompt that extends an earlier one reuses it up to the
    earlier one's last block end (32 of 40 tokens), hybrid or not; a prompt sharing
    only its first 20 tokens reuses all 20 with attention alone (a block and the
    next block's shared start), nothing with state layers (no state was kept at 16).
    Tokens are mlx-lm's either way."""
    loaded = build_random_model(family, tiny_config(family), seed=6)
    config = EngineConfig(max_num_seqs=4, prefill_chunk_tokens=64, warmup=False)
    client = EngineClient.from_loaded([(loaded, None)], config)
    try:
        first = [(i * 29 + 3) % 250 + 1 for i in range(40)]
        longer = first + [9, 8, 7, 6, 5, 4, 3]
        other = first[:20] + [(i * 17 + 1) % 250 + 1 for i in range(25)]
        for prompt, cached in ((first, 0), (longer, 32), (other, shorter)):
            tokens, got_cached = _run(client, loaded.name, prompt)
            assert got_cached == cached, (prompt, got_cached)
            assert tokens == reference(loaded.model, prompt, 8)
    finally:
        client.shutdown()
