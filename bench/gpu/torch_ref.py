"""Reference: a minimal llama in PyTorch with a static KV cache, decoded through CUDA graphs.

The same shapes as bench_decode.py's MLX model, so its tokens/s says what this GPU
does with a well-known fast path: fused QKV and gate/up weights, a preallocated
cache written in place at each row's position, one CUDA graph per batch size
replayed once per step (no per-step Python or launch overhead).

Run on the GPU machine (python3 there has torch):

    python3 bench/gpu/torch_ref.py --models 1b --batches 1,8,32,128 --out $OUT/torch.json

On a CPU machine ``--selfcheck`` compares it with mlx-lm's llama on the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import CONFIGS, kv_bytes_per_token  # noqa: E402


class TorchLlama:
    """Weights as plain tensors; ``decode`` is graph-capturable (no host syncs)."""

    def __init__(
        self,
        cfg: dict,
        device: str,
        dtype: torch.dtype,
        weights: dict | None = None,
        seed: int = 0,
        max_pos: int = 8192,
    ) -> None:
        self.cfg = cfg
        self.device, self.dtype = device, dtype
        H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = H // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.L = cfg["num_hidden_layers"]
        g = torch.Generator(device=device).manual_seed(seed)

        def rnd(*shape, fan_in=None):
            std = 1.0 / math.sqrt(fan_in or shape[-1])
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(
                dtype
            )

        def w(name, *shape):
            if weights is None:
                return rnd(*shape)
            return torch.as_tensor(weights[name], device=device).to(dtype)

        qd, kd = self.nh * self.hd, self.nkv * self.hd
        self.layers = []
        for i in range(self.L):
            p = f"model.layers.{i}."
            wq = w(p + "self_attn.q_proj.weight", qd, H)
            wk = w(p + "self_attn.k_proj.weight", kd, H)
            wv = w(p + "self_attn.v_proj.weight", kd, H)
            gate = w(p + "mlp.gate_proj.weight", F, H)
            up = w(p + "mlp.up_proj.weight", F, H)
            ones = torch.ones(H, device=device, dtype=dtype)
            self.layers.append(
                dict(
                    wqkv=torch.cat([wq, wk, wv]).contiguous(),
                    wo=w(p + "self_attn.o_proj.weight", H, qd),
                    wgu=torch.cat([gate, up]).contiguous(),
                    wd=w(p + "mlp.down_proj.weight", H, F),
                    ln1=ones if weights is None else w(p + "input_layernorm.weight", H),
                    ln2=ones if weights is None else w(p + "post_attention_layernorm.weight", H),
                )
            )
            del wq, wk, wv, gate, up
        self.emb = w("model.embed_tokens.weight", V, H)
        self.norm = (
            torch.ones(H, device=device, dtype=dtype)
            if weights is None
            else w("model.norm.weight", H)
        )
        self.lm_head = w("lm_head.weight", V, H)
        # RoPE tables (non-traditional: rotate the two halves), float32.
        inv = cfg["rope_theta"] ** (
            -torch.arange(0, self.hd, 2, device=device, dtype=torch.float32) / self.hd
        )
        ang = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv[None]
        self.cos, self.sin = ang.cos(), ang.sin()

    def weight_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for lay in self.layers for t in lay.values())
        return n + self.lm_head.numel() * self.lm_head.element_size() + self.norm.numel() * 2

    def new_cache(self, batch: int, cap: int):
        shape = (batch, self.nkv, cap, self.hd)
        kc = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.L)]
        vc = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.L)]
        return kc, vc

    def _rms(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def _rope(self, x, cos, sin):
        # x [..., D]; cos/sin broadcastable to [..., D/2]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)

    def decode(self, tok, pos, kc, vc):
        """tok [B] int64, pos [B] int64 (each row's position); writes the caches; -> logits [B, V]."""
        B = tok.shape[0]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        grp = nh // nkv
        cap = kc[0].shape[2]
        x = self.emb[tok]  # [B, H]
        cos = self.cos[pos][:, None, :]  # [B, 1, D/2]
        sin = self.sin[pos][:, None, :]
        bidx = torch.arange(B, device=tok.device)
        visible = (torch.arange(cap, device=tok.device)[None, :] <= pos[:, None])[:, None, None, :]
        scale = 1.0 / math.sqrt(hd)
        for i, lay in enumerate(self.layers):
            h = self._rms(x, lay["ln1"])
            qkv = h @ lay["wqkv"].t()
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.view(B, nh, hd), cos, sin)
            k = self._rope(k.view(B, nkv, hd), cos, sin)
            kc[i][bidx, :, pos] = k
            vc[i][bidx, :, pos] = v.view(B, nkv, hd)
            qg = q.view(B, nkv, grp, hd)
            s = (qg @ kc[i].transpose(-1, -2)).float() * scale  # [B, nkv, grp, cap]
            s = s.masked_fill(~visible, float("-inf"))
            p = torch.softmax(s, dim=-1).to(self.dtype)
            o = (p @ vc[i]).reshape(B, nh * hd)
            x = x + o @ lay["wo"].t()
            h = self._rms(x, lay["ln2"])
            gu = h @ lay["wgu"].t()
            gt, up = gu.chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gt) * up) @ lay["wd"].t()
        return self._rms(x, self.norm) @ self.lm_head.t()

    def prefill(self, tokens, kc=None, vc=None):
        """One sequence [T] from position 0; fills row 0 of the caches if given; -> logits [T, V]."""
        T = tokens.shape[0]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        x = self.emb[tokens]
        cos, sin = self.cos[:T][None], self.sin[:T][None]  # [1, T, D/2]
        for i, lay in enumerate(self.layers):
            h = self._rms(x, lay["ln1"])
            q, k, v = (h @ lay["wqkv"].t()).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.view(T, nh, hd).transpose(0, 1), cos, sin)  # [nh, T, hd]
            k = self._rope(k.view(T, nkv, hd).transpose(0, 1), cos, sin)
            v = v.view(T, nkv, hd).transpose(0, 1)
            if kc is not None:
                kc[i][0, :, :T] = k
                vc[i][0, :, :T] = v
            o = torch.nn.functional.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, enable_gqa=True
            )[0]
            x = x + o.transpose(0, 1).reshape(T, nh * hd) @ lay["wo"].t()
            h = self._rms(x, lay["ln2"])
            gt, up = (h @ lay["wgu"].t()).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gt) * up) @ lay["wd"].t()
        return self._rms(x, self.norm) @ self.lm_head.t()


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    e0.record()
    for _ in range(reps):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    dt = e0.elapsed_time(e1) / 1e3 / reps
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / dt


def bench_decode(model: TorchLlama, batch: int, prompt: int, steps: int) -> dict:
    cap = prompt + steps + 8
    kc, vc = model.new_cache(batch, cap)
    for c in kc + vc:  # random past: decode speed does not depend on its values
        c[:, :, :prompt].normal_()
    tok = torch.randint(0, model.cfg["vocab_size"], (batch,), device="cuda")
    pos = torch.full((batch,), prompt, dtype=torch.long, device="cuda")
    static_tok, static_pos = tok.clone(), pos.clone()

    def step():
        nxt = model.decode(static_tok, static_pos, kc, vc).argmax(-1)
        static_tok.copy_(nxt)
        static_pos.add_(1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up (cuBLAS handles, allocator) outside the graph
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    t = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t

    def reset():
        static_pos.fill_(prompt)
        static_tok.copy_(tok)
        torch.cuda.synchronize()

    # (1) replays back to back: the GPU time of one step
    reset()
    t = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    pipelined = time.perf_counter() - t
    # (2) a host sync + token copy per step, as a server that reads each token does
    reset()
    t = time.perf_counter()
    for _ in range(steps):
        graph.replay()
        static_tok.tolist()
    synced = time.perf_counter() - t
    del graph
    torch.cuda.empty_cache()
    return dict(
        capture_s=capture_s,
        step_ms=pipelined / steps * 1e3,
        step_ms_synced=synced / steps * 1e3,
        tok_s=batch * steps / pipelined,
        tok_s_synced=batch * steps / synced,
    )


def bench_prefill(model: TorchLlama, n: int) -> dict:
    tokens = torch.randint(0, model.cfg["vocab_size"], (n,), device="cuda")
    with torch.no_grad():
        t = time.perf_counter()
        model.prefill(tokens)[-1].float().sum().item()
        first = time.perf_counter() - t
        times = []
        for _ in range(3):
            t = time.perf_counter()
            model.prefill(tokens)[-1].float().sum().item()
            times.append(time.perf_counter() - t)
    best = sorted(times)[1]
    return dict(first_s=first, tok_s=n / best, ms=best * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--time-limit-s", type=float, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--selfcheck", action="store_true", help="CPU: compare with mlx-lm on tiny weights"
    )
    args = ap.parse_args()
    if args.selfcheck:
        selfcheck()
        return
    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = True
    props = torch.cuda.get_device_properties(0)
    out = dict(
        engine="torch",
        torch=torch.__version__,
        gpu=props.name,
        date=time.strftime("%Y-%m-%d"),
        copy_bw=copy_bandwidth(),
        rows=[],
    )
    print(
        f"torch {torch.__version__} on {props.name}: copy bandwidth {out['copy_bw'] / 1e12:.2f} TB/s (read+write)"
    )
    for name in args.models.split(","):
        cfg = CONFIGS[name]
        t = time.perf_counter()
        with torch.no_grad():
            model = TorchLlama(cfg, "cuda", torch.bfloat16)
        torch.cuda.synchronize()
        wb = model.weight_bytes()
        print(
            f"[{name}] built in {time.perf_counter() - t:.1f} s, {wb / 1e9:.2f} GB of weights read per step"
        )
        pf = bench_prefill(model, args.prefill)
        out["rows"].append(
            dict(model=name, quant="bf16", kind="prefill", n=args.prefill, weight_bytes=wb, **pf)
        )
        print(
            f"[{name}] prefill {args.prefill}: {pf['tok_s']:.0f} tok/s (first call {pf['first_s']:.2f} s)"
        )
        for b in map(int, args.batches.split(",")):
            if time.perf_counter() - t_start > args.time_limit_s:
                print(f"[{name}] time limit reached: skipping B={b}")
                continue
            with torch.no_grad():
                r = bench_decode(model, b, args.prompt, args.steps)
            kvb = kv_bytes_per_token(cfg, 2)
            out["rows"].append(
                dict(
                    model=name,
                    quant="bf16",
                    kind="decode",
                    batch=b,
                    weight_bytes=wb,
                    kv_bytes_token=kvb,
                    prompt=args.prompt,
                    steps=args.steps,
                    **r,
                )
            )
            print(
                f"[{name}] B={b:4d}: {r['tok_s']:8.0f} tok/s graph replays, {r['tok_s_synced']:8.0f} "
                f"with a sync per step ({r['step_ms']:.3f} / {r['step_ms_synced']:.3f} ms per step)"
            )
        del model
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def selfcheck() -> None:
    """Same weights in mlx-lm and here (float32, CPU): logits must agree."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    cfg = CONFIGS["tiny"]
    mx.random.seed(0)
    mlx_model = llama.Model(llama.ModelArgs(model_type="llama", **cfg))
    # non-trivial norm weights so that a mix-up shows
    for lay in mlx_model.model.layers:
        lay.input_layernorm.weight = mx.random.uniform(0.5, 1.5, lay.input_layernorm.weight.shape)
    mx.eval(mlx_model.parameters())
    weights = {k: np.array(v) for k, v in tree_flatten(mlx_model.parameters())}
    ref = TorchLlama(cfg, "cpu", torch.float32, weights=weights, max_pos=256)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, cfg["vocab_size"], 37)]
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in mlx_model.layers]
    want = np.array(mlx_model(mx.array([tokens]), cache=cache)[0].astype(mx.float32))
    kc, vc = ref.new_cache(2, 64)
    got = ref.prefill(torch.tensor(tokens), kc, vc).numpy()
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"prefill logits rel err {err:.2e}")
    assert err < 1e-4, err
    # three decode steps, the second row a copy of the first
    kc = [torch.cat([c[:1], c[:1]]) for c in kc]
    vc = [torch.cat([c[:1], c[:1]]) for c in vc]
    nxt = int(want[-1].argmax())
    for s in range(3):
        w = np.array(mlx_model(mx.array([[nxt]]), cache=cache)[0, -1].astype(mx.float32))
        pos = torch.full((2,), len(tokens) + s)
        g = ref.decode(torch.tensor([nxt, nxt]), pos, kc, vc).numpy()
        err = np.abs(g - w[None]).max() / np.abs(w).max()
        print(f"decode step {s}: rel err {err:.2e}")
        assert err < 1e-4, err
        nxt = int(w.argmax())
    print("selfcheck ok")


if __name__ == "__main__":
    main()
