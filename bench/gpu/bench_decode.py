"""Decode and prefill speed of markbase's own batched path on MLX's CUDA backend.

Runs on the GPU machine (docs/gpu-development.md):

    source bench/gpu/env.sh
    python3 bench/gpu/bench_decode.py --models 1b --quants bf16,q4 --out $OUT/mlx.json

A random-weight llama (bench/gpu/shapes.py) goes through ``engine.runner.ModelRunner``
with ``engine.kv.BatchKV`` caches exactly as ``engine.worker.ModelWorker._decode_step``
drives it: one forward per step for B rows, ``sample_batch``, ``mx.eval``, ``.tolist()``.
Each row is prefilled with ``ModelRunner.prefill`` into ``SequenceKV`` and joins with
``BatchKV.add``. Besides that path ("markbase") it times variants, each on a freshly
built batch of the same length, to find what a step costs:

- ``async``: the next step's graph is built and queued (``mx.async_eval``) before the
  host reads this step's tokens; tokens stay on the device between steps.
- ``static``: a preallocated cache written in place at a position held in an array
  (``mx.slice_update``), attention over the whole buffer under a mask, so every step
  has the same shapes; synced every step like markbase.
- ``compiled``: ``static`` with the whole step (forward + greedy pick + cache writes)
  under ``mx.compile``, pipelined like ``async``; ``compiled_sync`` syncs every step.
- ``ragged``: markbase with rows of different lengths (padding, so a mask every step).
- ``fused``: Q/K/V and gate/up projections as one matmul each (weights concatenated).
- ``gqa``: decode attention under a mask as grouped matmuls (``gqa_decode_attention``)
  instead of MLX's SDPA, whose CUDA fused kernels refuse array masks.
- ``worker``: the real ``ModelWorker`` behind ``EngineClient`` (admission, chunked
  prefill, detokenizer, stop strings, metrics), timed per step.

Flags combine with "+": ``ragged+gqa+fused+async``, ``worker+gqa+fused``.

"markbase" here is ``ModelRunner(model, fused_decode=False)``: the runner's plain path,
not ``engine.model.decode_step.FusedDecodeStep``, so that the variants above keep their
meaning. ``worker`` is the real engine (fused step included, no
warm-up). The engine's fused step against the unfused one, and the warm-up, are
measured by ``bench_engine.py``.

It also measures the device copy bandwidth (for the floor: weight + KV bytes per step
over bandwidth) and prefill tokens/s, and reports first-call (JIT) times.
On a CPU machine ``--models tiny --check`` checks that every variant yields the same
tokens as the markbase path.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import CONFIGS, kv_bytes_per_token  # noqa: E402

from engine.runner import ModelRunner  # noqa: E402
from engine.sampler import RowSampler, sample_batch  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

now = time.perf_counter


def log(msg: str) -> None:
    print(msg, flush=True)


# -- model ----------------------------------------------------------------------------
def build_model(cfg: dict, quant: str, seed: int = 0):
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", **cfg))
    dtype = mx.float32 if quant == "f32" else mx.bfloat16
    model.set_dtype(dtype)
    if quant == "q4":
        nn.quantize(model, group_size=64, bits=4)
    elif quant == "q8":
        nn.quantize(model, group_size=64, bits=8)
    mx.eval(model.parameters())
    return model


def randomize(model, seed: int = 0, scale: float = 4.0) -> None:
    """Numpy-drawn float32 weights (the same on every device) that give varied greedy tokens."""
    import numpy as np
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            v = 1 + 0.1 * rng.standard_normal(p.shape)
        elif "embed" in name:
            v = rng.standard_normal(p.shape)
        else:
            v = scale * rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        new.append((name, mx.array(v.astype(np.float32))))
    model.load_weights(new)
    mx.eval(model.parameters())


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters a decode step reads: all but the embedding table (one row each)."""
    from mlx.utils import tree_flatten

    total = 0
    for name, p in tree_flatten(model.parameters()):
        if "embed_tokens" not in name:
            total += p.nbytes
    return total


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes read + written per second by a device copy (an elementwise op over 4 GiB)."""
    if mx.default_device() == mx.cpu:
        nbytes = 64 << 20
    a = mx.random.normal((nbytes // 2 // 4096, 4096)).astype(mx.bfloat16)
    mx.eval(a)
    for _ in range(2):
        mx.eval(a * 1)
    reps = 5
    t = now()
    for _ in range(reps):
        b = a * 1
        mx.eval(b)
    dt = (now() - t) / reps
    del a, b
    mx.clear_cache()
    return 2 * nbytes / dt


# -- batches --------------------------------------------------------------------------
def greedy_samplers(n: int) -> list[RowSampler]:
    return [RowSampler.from_params(SamplingParams(temperature=0.0)) for _ in range(n)]


def prefill_row(runner: ModelRunner, tokens: list[int]):
    """One row through ModelRunner.prefill; -> (per-layer (k, v) [1, H, L, D], first token)."""
    kv = runner.new_sequence_kv()
    logits = runner.prefill(kv, tokens, want_logits=True)
    token = sample_batch(logits[None], greedy_samplers(1))
    mx.eval(token, [c.keys for c in kv], [c.values for c in kv])
    return [c.kv() for c in kv], int(token.item())


def build_batch(runner: ModelRunner, layer_kv, lengths: list[int]):
    """A BatchKV per layer holding row r = the first lengths[r] positions of layer_kv."""
    batch = runner.new_batch_kv()
    t = now()
    for r, n in enumerate(lengths):
        for layer, (k, v) in zip(batch, layer_kv):
            layer.add(k[:, :, :n], v[:, :, :n])
        if r % 8 == 7:
            mx.eval([lay.keys for lay in batch], [lay.values for lay in batch])
    mx.eval([lay.keys for lay in batch], [lay.values for lay in batch])
    return batch, now() - t


def ragged_lengths(prompt: int, b: int) -> list[int]:
    return [prompt - (r * 37) % min(prompt, 128) for r in range(b)]


# -- decode loops -------------------------------------------------------------------------
def summarize(times: list[float], b: int, extra: dict | None = None) -> dict:
    med = statistics.median(times)
    out = dict(
        steps=len(times),
        step_ms_median=med * 1e3,
        step_ms_mean=statistics.fmean(times) * 1e3,
        step_ms_max=max(times) * 1e3,
        tok_s=b / med,
        tok_s_mean=b * len(times) / sum(times),
    )
    if extra:
        out.update(extra)
    return out


def loop_markbase(runner, batch, first_tokens, steps, collect=None):
    """What ModelWorker._decode_step does, with timers around its three parts."""
    samplers = greedy_samplers(len(first_tokens))
    toks = list(first_tokens)
    times, build, ev, tl = [], [], [], []
    for _ in range(steps):
        t0 = now()
        logits = runner.decode(batch, toks)
        sampled = sample_batch(logits, samplers)
        t1 = now()
        mx.eval(sampled)
        t2 = now()
        toks = sampled.tolist()
        t3 = now()
        times.append(t3 - t0)
        build.append(t1 - t0)
        ev.append(t2 - t1)
        tl.append(t3 - t2)
        if collect is not None:
            collect.append(toks)
    return times, dict(
        build_ms=statistics.median(build) * 1e3,
        eval_ms=statistics.median(ev) * 1e3,
        tolist_ms=statistics.median(tl) * 1e3,
    )


def _decode_array(runner, batch, tok: mx.array) -> mx.array:
    return runner.model(tok[:, None], cache=batch)[:, -1, :]


def loop_async(runner, batch, first_tokens, steps, collect=None, read_tokens=True):
    """Pipelined: queue step i+1 before reading step i's tokens (mlx-lm's generate_step).

    Timers: ``build`` (Python builds the graph), ``enqueue`` (``mx.async_eval``: MLX
    encodes the graph into CUDA graphs and launches them, on this thread), ``wait``
    (``.tolist()`` of the previous step: what the GPU still had to do).
    """
    samplers = greedy_samplers(len(first_tokens))
    y = mx.array(first_tokens, dtype=mx.int32)
    nxt = sample_batch(_decode_array(runner, batch, y), samplers)
    mx.async_eval(nxt)
    times, build, enq, wait = [], [], [], []
    t = now()
    for _ in range(steps):
        y = nxt
        t0 = now()
        nxt = sample_batch(_decode_array(runner, batch, y), samplers)
        t1 = now()
        mx.async_eval(nxt)
        t2 = now()
        if read_tokens:
            toks = y.tolist()
            if collect is not None:
                collect.append(toks)
        t3 = now()
        build.append(t1 - t0)
        enq.append(t2 - t1)
        wait.append(t3 - t2)
        times.append(t3 - t)
        t = t3
    mx.eval(nxt)
    med = statistics.median
    return times, dict(
        build_ms=med(build) * 1e3, enqueue_ms=med(enq) * 1e3, wait_ms=med(wait) * 1e3
    )


# -- fused projections (a variant of the model, swapped in and out) ----------------------
def _lin(f, x):
    if isinstance(f, tuple):
        w, sc, bi, gs, bits = f
        return mx.quantized_matmul(x, w, sc, bi, transpose=True, group_size=gs, bits=bits)
    return x @ f.T


def _cat(mods):
    if isinstance(mods[0], nn.QuantizedLinear):
        m = mods[0]
        return (
            mx.concatenate([q.weight for q in mods]),
            mx.concatenate([q.scales for q in mods]),
            mx.concatenate([q.biases for q in mods]),
            m.group_size,
            m.bits,
        )
    return mx.concatenate([q.weight for q in mods])


class FusedAttention(llama.Attention):
    """One matmul for Q, K and V (weights concatenated), else mlx-lm's llama Attention."""

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        nq, nk = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = mx.split(_lin(self._fqkv, x), [nq, nq + nk], axis=-1)
        queries = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = k.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        out = llama.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class FusedMLP(llama.MLP):
    """One matmul for gate and up."""

    def __call__(self, x):
        g, u = mx.split(_lin(self._fgu, x), 2, axis=-1)
        return self.down_proj(llama.swiglu(g, u))


def fuse(model) -> None:
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        object.__setattr__(a, "_fqkv", _cat([a.q_proj, a.k_proj, a.v_proj]))
        object.__setattr__(m, "_fgu", _cat([m.gate_proj, m.up_proj]))
        a.__class__, m.__class__ = FusedAttention, FusedMLP
    mx.eval([(lay.self_attn._fqkv, lay.mlp._fgu) for lay in model.layers])


def unfuse(model) -> None:
    for layer in model.layers:
        layer.self_attn.__class__, layer.mlp.__class__ = llama.Attention, llama.MLP
        object.__delattr__(layer.self_attn, "_fqkv")
        object.__delattr__(layer.mlp, "_fgu")


# -- decode attention under a mask, GQA-aware (a variant of the attention call) -------------
_ORIG_SDPA = llama.scaled_dot_product_attention


def gqa_decode_attention(q, k, v, scale, mask):
    """One query position per row, K/V heads shared by groups of query heads, any mask.

    What MLX's own fallback should do when its fused kernels refuse an array mask: the
    query heads of a group become the rows of one small matmul against their K/V head,
    so K and V are read once (no per-head copies), scores [B, Hkv, g, T] stay small.
    """
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    qg = (q * scale).reshape(B, Hkv, (Hq // Hkv) * L, D)
    s = qg @ k.swapaxes(-1, -2)
    if mask.dtype == mx.bool_:
        s = mx.where(mask, s, mx.array(-mx.inf, dtype=s.dtype))
    else:
        s = s + mask
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(v.dtype)
    return (p @ v).reshape(B, Hq, L, D)


def _sdpa_gqa(queries, keys, values, cache, scale, mask, sinks=None):
    if (
        isinstance(mask, mx.array)
        and queries.shape[2] == 1
        and sinks is None
        and not hasattr(cache, "bits")
    ):
        return gqa_decode_attention(queries, keys, values, scale, mask)
    return _ORIG_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


class patched:
    """Swap in the model variants named in ``flags`` ("fused", "gqa") for a block."""

    def __init__(self, model, flags) -> None:
        self.model, self.flags = model, set(flags)

    def __enter__(self):
        if "fused" in self.flags:
            fuse(self.model)
        if "gqa" in self.flags:
            llama.scaled_dot_product_attention = _sdpa_gqa
        return self

    def __exit__(self, *exc):
        if "fused" in self.flags:
            unfuse(self.model)
        llama.scaled_dot_product_attention = _ORIG_SDPA
        return False


# -- matmul microbenchmark --------------------------------------------------------------
def matmul_bandwidth(cfg: dict, quant: str, rows: int, layers: int = 16) -> dict:
    """The MLP matmuls of ``layers`` layers chained lazily, evaluated once: weight bytes / time.

    Also evaluated after every matmul, to show the cost of one eval (graph encode + launch
    + sync) per op.
    """
    H, F = cfg["hidden_size"], cfg["intermediate_size"]
    ws = []
    for _ in range(layers):
        g, u, d = (mx.random.normal(s).astype(mx.bfloat16) * 0.02 for s in ((F, H), (F, H), (H, F)))
        if quant == "q4":
            g, u, d = (tuple(mx.quantize(w, group_size=64, bits=4)) for w in (g, u, d))
        ws.append((g, u, d))
    mx.eval(ws)

    def mm(x, w):
        if quant == "q4":
            return mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)
        return x @ w.T

    nbytes = sum(a.nbytes for w in ws for t in w for a in (t if isinstance(t, tuple) else (t,)))
    x0 = mx.random.normal((rows, H)).astype(mx.bfloat16)

    def chain(sync_each: bool):
        x = x0
        for g, u, d in ws:
            h = mm(x, g) * mm(x, u)
            if sync_each:
                mx.eval(h)
            x = mm(h, d)
            if sync_each:
                mx.eval(x)
        mx.eval(x)

    out = dict(rows=rows, bytes=nbytes, ops=3 * layers)
    for sync_each in (False, True):
        chain(sync_each)
        times = []
        for _ in range(5):
            t = now()
            chain(sync_each)
            times.append(now() - t)
        dt = statistics.median(times)
        key = "sync_each" if sync_each else "one_eval"
        out[key + "_ms"] = dt * 1e3
        out[key + "_bw"] = nbytes / dt
    mx.clear_cache()
    return out


class _Step:
    """Per-step state shared by every layer's StaticKV inside one forward."""

    def __init__(self, t: mx.array, offset: mx.array, mask: mx.array) -> None:
        self.t, self.offset, self.mask = t, offset, mask


class StaticKV:
    """A fixed-size cache ([B, H, cap, D]) written at time index ``t`` (an array).

    Rows are left-padded as in BatchKV: row r holds its tokens at [pad[r], t); its
    RoPE position is ``offset[r]``. Shapes never change, so a step can be compiled.
    """

    def __init__(self, keys: mx.array, values: mx.array, step: _Step) -> None:
        self.keys, self.values, self.step = keys, values, step

    @property
    def offset(self) -> mx.array:
        return self.step.offset

    def update_and_fetch(self, keys, values):
        self.keys = mx.slice_update(self.keys, keys, self.step.t, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.step.t, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n, window_size=None, return_array=False):
        assert n == 1 and window_size is None
        return self.step.mask


def static_state(layer_kv, lengths: list[int], cap: int):
    """Initial (t, offset, pad, [k0, v0, k1, v1, ...]) for rows of the given lengths."""
    t0 = max(lengths)
    pads = [t0 - n for n in lengths]
    kv = []
    for k, v in layer_kv:
        rows_k, rows_v = [], []
        for n, p in zip(lengths, pads):
            widths = [(0, 0), (0, 0), (p, cap - t0), (0, 0)]
            rows_k.append(mx.pad(k[:, :, :n], widths))
            rows_v.append(mx.pad(v[:, :, :n], widths))
        kv += [mx.concatenate(rows_k), mx.concatenate(rows_v)]
        mx.eval(kv[-2:])
    t = mx.array([t0], dtype=mx.int32)
    offset = mx.array(lengths, dtype=mx.int32)
    pad = mx.array(pads, dtype=mx.int32)
    return t, offset, pad, kv


def make_static_step(model, n_layers: int, samplers):
    def step(tok, t, offset, pad, *kv):
        cap = kv[0].shape[2]
        kidx = mx.arange(cap, dtype=mx.int32)
        visible = (kidx[None, :] >= pad[:, None]) & (kidx[None, :] <= t)
        st = _Step(t, offset, visible[:, None, None, :])
        caches = [StaticKV(kv[2 * i], kv[2 * i + 1], st) for i in range(n_layers)]
        logits = model(tok[:, None], cache=caches)[:, -1, :]
        nxt = sample_batch(logits, samplers)
        out = [nxt, t + 1, offset + 1]
        for c in caches:
            out += [c.keys, c.values]
        return out

    return step


_STEP_FNS: dict = {}


def static_step_fn(model, batch: int, compiled: bool):
    """One step function per (model, batch, compiled): a compiled one traces once."""
    key = (id(model), batch, compiled)
    if key not in _STEP_FNS:
        fn = make_static_step(model, len(model.layers), greedy_samplers(batch))
        _STEP_FNS[key] = mx.compile(fn) if compiled else fn
    return _STEP_FNS[key]


def loop_static(model, state, first_tokens, steps, compiled: bool, pipelined: bool, collect=None):
    """``steps`` forwards through StaticKV caches; the first one (trace + JIT) is not timed."""
    fn = static_step_fn(model, len(first_tokens), compiled)
    t, offset, pad, kv = state
    tok = mx.array(first_tokens, dtype=mx.int32)
    t_first = now()
    prev = fn(tok, t, offset, pad, *kv)
    del kv, state
    mx.eval(prev)
    first_s = now() - t_first
    if collect is not None and not pipelined:
        collect.append(prev[0].tolist())
    times = []
    t_prev = now()
    for _ in range(steps - 1):
        outs = fn(prev[0], prev[1], prev[2], pad, *prev[3:])
        last_tok = prev[0]
        prev = None  # drop the old caches before evaluating: slice_update can then write in place
        if pipelined:
            mx.async_eval(outs)
            toks = last_tok.tolist()  # the previous step's tokens; this step is queued
        else:
            mx.eval(outs)
            toks = outs[0].tolist()
        if collect is not None:
            collect.append(toks)
        prev = outs
        t1 = now()
        times.append(t1 - t_prev)
        t_prev = t1
    mx.eval(prev)
    if collect is not None and pipelined:
        collect.append(prev[0].tolist())
    return times, dict(first_call_s=first_s)


# -- the benchmark ------------------------------------------------------------------------
class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.t_start = now()
        self.rows: list[dict] = []

    def left(self) -> float:
        return self.args.time_limit_s - (now() - self.t_start)

    def record(self, **row) -> dict:
        self.rows.append(row)
        if self.args.out:
            self.save()
        return row

    def save(self) -> None:
        meta = dict(
            engine="mlx",
            mlx=mx.__version__,
            device=str(mx.default_device()),
            gpu=self.args.gpu_name,
            date=time.strftime("%Y-%m-%d"),
            copy_bw=self.copy_bw,
        )
        Path(self.args.out).write_text(json.dumps(dict(meta, rows=self.rows), indent=1))

    def run(self) -> None:
        a = self.args
        self.copy_bw = copy_bandwidth()
        log(
            f"mlx {mx.__version__} on {mx.default_device()} ({a.gpu_name}): "
            f"copy bandwidth {self.copy_bw / 1e12:.2f} TB/s (read+write)"
        )
        if a.matmul:
            for name in a.models.split(","):
                for quant in a.quants.split(","):
                    for rows in map(int, a.batches.split(",")):
                        r = matmul_bandwidth(CONFIGS[name], quant, rows)
                        self.record(kind="matmul", model=name, quant=quant, **r)
                        log(
                            f"[{name} {quant}] MLP matmuls, {rows:4d} rows: one eval "
                            f"{r['one_eval_ms']:.3f} ms = {r['one_eval_bw'] / 1e12:.2f} TB/s; "
                            f"eval per op {r['sync_each_ms']:.3f} ms "
                            f"({(r['sync_each_ms'] - r['one_eval_ms']) / r['ops'] * 1e3:.0f} us/op more)"
                        )
            return
        for name in a.models.split(","):
            for quant in a.quants.split(","):
                if self.left() < 20:
                    log(f"[{name} {quant}] time limit reached: skipped")
                    continue
                try:
                    self.run_model(name, quant)
                except Exception:
                    log(f"[{name} {quant}] FAILED:\n{traceback.format_exc()}")
                    self.record(
                        model=name, quant=quant, kind="error", error=traceback.format_exc()[-2000:]
                    )
                mx.clear_cache()
        if a.out:
            self.save()

    def run_model(self, name: str, quant: str) -> None:
        a = self.args
        cfg = CONFIGS[name]
        tag = f"[{name} {quant}]"
        t = now()
        model = build_model(cfg, quant)
        wb = weight_bytes_per_step(model)
        kvb = kv_bytes_per_token(cfg, 4 if quant == "f32" else 2)
        log(
            f"{tag} built in {now() - t:.1f} s; {wb / 1e9:.2f} GB of weights read per step; "
            f"KV {kvb} B/token"
        )
        runner = ModelRunner(model, fused_decode=False)  # module docstring
        common = dict(model=name, quant=quant, weight_bytes=wb, kv_bytes_token=kvb, prompt=a.prompt)

        # prefill: the first call JIT-compiles
        if a.prefill:
            vocab = cfg["vocab_size"]
            toks = [(i * 7919 + 13) % vocab for i in range(a.prefill)]
            times = []
            for _ in range(4):
                t = now()
                prefill_row(runner, toks)
                times.append(now() - t)
            med = statistics.median(times[1:])
            self.record(
                kind="prefill",
                n=a.prefill,
                chunk=a.prefill,
                first_s=times[0],
                ms=med * 1e3,
                tok_s=a.prefill / med,
                **common,
            )
            log(
                f"{tag} prefill {a.prefill} tokens: {a.prefill / med:.0f} tok/s "
                f"({med * 1e3:.1f} ms; first call {times[0]:.2f} s)"
            )
            if a.chunk and a.chunk < a.prefill:
                ctimes = []
                for _ in range(3):
                    kv = runner.new_sequence_kv()
                    t = now()
                    for s in range(0, a.prefill, a.chunk):
                        last = s + a.chunk >= a.prefill
                        out = runner.prefill(kv, toks[s : s + a.chunk], want_logits=last)
                    mx.eval(out)
                    ctimes.append(now() - t)
                med = statistics.median(ctimes[1:]) if len(ctimes) > 1 else ctimes[0]
                self.record(
                    kind="prefill",
                    n=a.prefill,
                    chunk=a.chunk,
                    first_s=ctimes[0],
                    ms=med * 1e3,
                    tok_s=a.prefill / med,
                    **common,
                )
                log(
                    f"{tag} prefill {a.prefill} tokens in chunks of {a.chunk}: {a.prefill / med:.0f} tok/s"
                )

        # one prefilled row, reused for every row of every batch
        prompt = [(i * 104729 + 7) % cfg["vocab_size"] for i in range(a.prompt)]
        layer_kv, first = prefill_row(runner, prompt)
        variants = [v for v in a.variants.split(",") if v]
        for rep, b in [(r, b) for r in range(a.repeat) for b in map(int, a.batches.split(","))]:
            for variant in ["markbase"] + [v for v in variants if v != "markbase"]:
                if variant != "markbase" and b not in a.variant_batches_list:
                    continue
                if variant.startswith("worker") or ("ragged" in variant and b == 1):
                    continue  # worker: below, once per model; ragged needs two rows
                if self.left() < 15:
                    log(f"{tag} B={b} {variant}: time limit reached, skipped")
                    continue
                try:
                    r = self.run_variant(runner, model, layer_kv, first, b, variant)
                except Exception:
                    log(f"{tag} B={b} {variant} FAILED:\n{traceback.format_exc()}")
                    self.record(
                        kind="error",
                        batch=b,
                        variant=variant,
                        error=traceback.format_exc()[-2000:],
                        **common,
                    )
                    continue
                vname = f"{variant}@{a.tag}" if a.tag else variant
                row = self.record(kind="decode", batch=b, variant=vname, rep=rep, **common, **r)
                extra = ""
                if "enqueue_ms" in r:
                    extra = (
                        f"  [build {r['build_ms']:.2f} enqueue {r['enqueue_ms']:.2f} "
                        f"wait {r['wait_ms']:.3f} ms]"
                    )
                elif "build_ms" in r:
                    extra = (
                        f"  [build {r['build_ms']:.2f} eval {r['eval_ms']:.2f} "
                        f"tolist {r['tolist_ms']:.3f} ms]"
                    )
                log(
                    f"{tag} B={b:4d} {variant:14s} {row['tok_s']:9.0f} tok/s  step {row['step_ms_median']:7.3f} "
                    f"ms (mean {row['step_ms_mean']:.3f}, max {row['step_ms_max']:.1f}; first step "
                    f"{row.get('first_step_s', row.get('first_call_s', 0)):.2f} s){extra}"
                )
                mx.clear_cache()
        for wv in [v for v in variants if v.startswith("worker")]:
            for b in a.variant_batches_list:
                if self.left() < 30:
                    log(f"{tag} {wv} B={b}: time limit reached, skipped")
                    continue
                try:
                    with patched(model, wv.split("+")):
                        r = run_worker(model, cfg, quant, b, a.prompt, a.steps)
                except Exception:
                    log(f"{tag} {wv} B={b} FAILED:\n{traceback.format_exc()}")
                    continue
                vname = f"{wv}@{a.tag}" if a.tag else wv
                self.record(kind="decode", batch=b, variant=vname, **common, **r)
                log(
                    f"{tag} B={b:4d} {vname:14s} {r['tok_s']:9.0f} tok/s  step {r['step_ms_median']:7.3f} ms "
                    f"(decode part {r['decode_ms_median']:.3f} ms; {r['steps']} steps at full batch)"
                )
        del model, runner, layer_kv
        _STEP_FNS.clear()
        mx.clear_cache()

    def run_variant(self, runner, model, layer_kv, first, b, variant) -> dict:
        a = self.args
        steps, warm = a.steps, a.warmup
        equal = [a.prompt] * b
        first_tokens = [first] * b
        # composite names: "ragged+gqa+fused+async" = ragged rows, GQA attention under the
        # mask, fused projections, pipelined loop
        alias = {"fused": "fused", "fused_async": "fused+async"}
        flags = set(alias.get(variant, variant).split("+"))
        if flags & {"fused", "gqa"}:
            base = "+".join(sorted(flags - {"fused", "gqa"})) or "markbase"
            with patched(model, flags):
                return self.run_variant(runner, model, layer_kv, first, b, base)
        if flags == {"ragged", "async"}:
            variant = "ragged_async"
        lengths = ragged_lengths(a.prompt, b) if "ragged" in flags else equal
        if variant in ("markbase", "ragged", "async", "nosync", "ragged_async"):
            batch, add_s = build_batch(runner, layer_kv, lengths)
            t = now()
            if variant in ("markbase", "ragged"):
                loop_markbase(runner, batch, first_tokens, 1)
                first_step = now() - t
                loop_markbase(runner, batch, first_tokens, warm - 1)
                times, extra = loop_markbase(runner, batch, first_tokens, steps)
            else:
                read = variant != "nosync"
                loop_async(runner, batch, first_tokens, warm, read_tokens=read)
                first_step = now() - t
                times, extra = loop_async(runner, batch, first_tokens, steps, read_tokens=read)
            kv_len = batch[0].length
            del batch
            return summarize(
                times, b, dict(first_step_s=first_step, add_s=add_s, kv_len_end=kv_len, **extra)
            )
        if variant in ("static", "compiled", "compiled_sync"):
            cap = -(-(max(lengths) + warm + steps + 1) // 64) * 64
            state = static_state(layer_kv, lengths, cap)
            compiled = variant != "static"
            pipelined = variant == "compiled"
            # warm-up run (first call traces + JIT), then a fresh state for the timed run
            _, extra = loop_static(model, state, first_tokens, warm, compiled, pipelined)
            state = static_state(layer_kv, lengths, cap)
            times, _ = loop_static(model, state, first_tokens, steps, compiled, pipelined)
            del state
            return summarize(times, b, dict(cap=cap, **extra))
        raise ValueError(f"unknown variant {variant}")


# -- the real worker ----------------------------------------------------------------------
class _Detok:
    def add_token(self, token: int) -> str:
        return "x"

    def flush(self) -> str:
        return ""


class TrivialTokenizer:
    """What ModelWorker needs from a tokenizer, no more."""

    eos_token_ids = frozenset({0})
    has_chat_template = False

    def detokenizer(self):
        return _Detok()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "x" * len(ids)


def engine_config(**kw):
    from engine.config import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in kw.items() if k in names})


def loaded_model(model, cfg: dict, quant: str, name: str = "random"):
    from engine.loading.loaded_model import LoadedModel

    fields = {f.name for f in dataclasses.fields(LoadedModel)}
    kw = dict(
        name=name,
        architecture="llama",
        model=model,
        tokenizer=TrivialTokenizer(),
        context_length=8192,
        source="random",
        weight_format=quant,
        config=cfg,
    )
    return LoadedModel(**{k: v for k, v in kw.items() if k in fields})


def batch_config(b: int, prompt: int, max_tokens: int):
    """An engine for ``b`` requests of ``prompt`` + ``max_tokens`` at once: every row in
    the batch, KV for all, no prefix cache, no warm-up (the steps are timed after the
    batch fills, and the benchmarks predate the engine's warm-up)."""
    return engine_config(
        max_num_seqs=b,
        max_kv_tokens=b * (prompt + max_tokens + 16),
        prefix_cache_tokens=0,
        max_queued_requests=max(256, b),
        queue_timeout_s=600.0,
        warmup=False,
    )


async def greedy_requests(client, b: int, prompt: int, max_tokens: int, vocab: int) -> list[int]:
    """``b`` greedy requests of ``prompt`` tokens (different per request) and
    ``max_tokens`` each, EOS ignored, all at once through ``client``; the tokens each got."""
    from engine.types import GenerationRequest

    async def one(i):
        toks = [(j * 31 + i * 7 + 1) % vocab for j in range(prompt)]
        req = GenerationRequest(
            request_id=f"b{i}",
            model="random",
            prompt_tokens=toks,
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        n = 0
        async for ev in client.generate(req):
            n += len(ev.token_ids)
        return n

    return list(await asyncio.gather(*(one(i) for i in range(b))))


def run_worker(model, cfg: dict, quant: str, b: int, prompt: int, steps: int) -> dict:
    """B requests through EngineClient; per-step times once all B rows decode together."""
    from engine.client import EngineClient

    max_tokens = steps + b + 8  # rows join one per step; keep all B together for ~steps steps
    conf = batch_config(b, prompt, max_tokens)
    client = EngineClient.from_loaded([(loaded_model(model, cfg, quant), None)], conf)
    worker = client.worker("random")
    rec = []
    inner = worker._decode_step

    def timed_decode():
        t = now()
        inner()
        rec.append(("decode", len(worker.running), now() - t))

    outer = worker.step

    def timed_step():
        n, busy = len(worker.running), bool(worker.prefilling or worker.waiting)
        t = now()
        outer()
        rec.append(("step", n, now() - t, busy))

    worker._decode_step = timed_decode
    worker.step = timed_step
    t = now()
    try:
        got = asyncio.run(greedy_requests(client, b, prompt, max_tokens, cfg["vocab_size"]))
    finally:
        client.shutdown()
    wall = now() - t
    full = [r[2] for r in rec if r[0] == "step" and r[1] == b and not r[3]]
    dec = [r[2] for r in rec if r[0] == "decode" and r[1] == b]
    if not full:
        raise RuntimeError(f"never {b} rows decoding without prefill work: {len(rec)} records")
    out = summarize(
        full,
        b,
        dict(
            decode_ms_median=statistics.median(dec) * 1e3,
            wall_s=wall,
            tokens=sum(got),
            max_tokens=max_tokens,
        ),
    )
    return out


# -- CPU check ----------------------------------------------------------------------------
def check(args) -> None:
    """Every variant must produce the markbase path's greedy tokens (tiny model, float32)."""
    cfg = CONFIGS["tiny"]
    model = build_model(cfg, "f32")
    randomize(model)
    runner = ModelRunner(model, fused_decode=False)
    prompt = [(i * 104729 + 7) % cfg["vocab_size"] for i in range(40)]
    layer_kv, first = prefill_row(runner, prompt)
    steps = 12
    for lengths in ([40, 40, 40], ragged_lengths(40, 5)):
        # each row's first token comes from its own prefix
        firsts = []
        for n in lengths:
            kv = runner.new_sequence_kv()
            logits = runner.prefill(kv, prompt[:n], want_logits=True)
            firsts.append(int(mx.argmax(logits).item()))
        ref = []
        batch, _ = build_batch(runner, layer_kv, lengths)
        loop_markbase(runner, batch, firsts, steps, collect=ref)
        # alone, row by row, must match too
        for r, n in enumerate(lengths):
            alone = []
            bt, _ = build_batch(runner, layer_kv, [n])
            loop_markbase(runner, bt, [firsts[r]], steps, collect=alone)
            assert [x[0] for x in alone] == [x[r] for x in ref], f"row {r} alone differs"
        got = []
        batch, _ = build_batch(runner, layer_kv, lengths)
        loop_async(runner, batch, firsts, steps, collect=got)
        assert got == ref, ("async", got, ref)
        for flags in (["fused"], ["gqa"], ["fused", "gqa"]):
            got = []
            with patched(model, flags):
                batch, _ = build_batch(runner, layer_kv, lengths)
                loop_markbase(runner, batch, firsts, steps, collect=got)
            assert got == ref, (flags, got, ref)
        for compiled, pipelined in ((False, False), (True, False), (True, True)):
            cap = -(-(max(lengths) + steps + 2) // 64) * 64
            got = []
            loop_static(
                model,
                static_state(layer_kv, lengths, cap),
                firsts,
                steps,
                compiled,
                pipelined,
                collect=got,
            )
            assert got[: len(ref)] == ref, (compiled, pipelined, got, ref)
        print(f"check ok for lengths {lengths}: {ref[:3]}...")
    r = run_worker(model, cfg, "f32", 3, 16, 8)
    print(f"worker ok: {r['tok_s']:.0f} tok/s at B=3 on {mx.default_device()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b")
    ap.add_argument("--quants", default="bf16,q4")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument(
        "--variants",
        default="async,compiled,compiled_sync,static,ragged,worker",
        help="besides markbase; run at --variant-batches only",
    )
    ap.add_argument("--variant-batches", default="1,32,128")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument(
        "--chunk", type=int, default=512, help="also time the prefill in chunks of this"
    )
    ap.add_argument("--time-limit-s", type=float, default=480)
    ap.add_argument("--gpu-name", default="")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="run the decode matrix this many times")
    ap.add_argument("--tag", default="", help="suffix for variant names (e.g. an env setting)")
    ap.add_argument("--matmul", action="store_true", help="only the matmul microbenchmark")
    ap.add_argument("--check", action="store_true", help="CPU: variants give the markbase tokens")
    args = ap.parse_args()
    args.variant_batches_list = [int(x) for x in args.variant_batches.split(",") if x]
    if args.check:
        check(args)
        return
    Bench(args).run()


if __name__ == "__main__":
    main()
