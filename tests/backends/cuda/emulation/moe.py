"""engine/backends/cuda/products/moe.py's kernels transcribed block by block, warp by warp
and lane by lane in numpy, against the dequantized product (their index logic checked
without a GPU: the expert of each slot, the pair lists, weight/scale/x addressing, the
nibble order, the output rows). It checks the mapping, not the CUDA code itself: change
both together.

    .venv/bin/python -m tests.backends.cuda.emulation.moe

Prints the largest relative error per case; exits 1 if one is above 1e-5.
"""

from __future__ import annotations

import sys

import numpy as np

from engine.backends.cuda.products import moe as gpu_moe


def run_kernel(kind, x, idx, ws, template, slots, tiles):
    """One launch: ``ws`` is [(w, scales, biases)] (two for glu); returns y [P, N]."""
    R, RR, WARPS, MMAX, DIV, ACT, LCAP, GS = (
        template[k] for k in ("R", "RR", "WARPS", "MMAX", "DIV", "ACT", "LCAP", "GS")
    )
    P = idx.shape[0]
    N = ws[0][0].shape[1]
    K = x.shape[1]
    y = np.full((P, N), np.nan, np.float32)
    for block in range(slots * tiles):
        slot, tile = divmod(block, tiles)
        present = np.zeros(32, np.uint32)
        for p in range(P):
            e = int(idx[p])
            present[e >> 5] |= np.uint32(1 << (e & 31))
        s, found = slot, -1
        for i in range(32):
            bits = int(present[i])
            c = bin(bits).count("1")
            if s < c:
                for _ in range(s):
                    bits &= bits - 1
                found = i * 32 + (bits & -bits).bit_length() - 1
                break
            s -= c
        e = found
        if e < 0:
            continue
        pairs = [p for p in range(P) if int(idx[p]) == e][:LCAP]
        chunks = K // 32
        for warp in range(WARPS):
            n0 = (tile * WARPS + warp) * R
            if n0 >= N:
                continue
            for m0 in range(0, len(pairs), MMAX):
                mc = min(MMAX, len(pairs) - m0)
                rows = [pairs[m0 + (m if m < mc else 0)] // DIV for m in range(MMAX)]
                acc = np.zeros((32, MMAX, RR), np.float64)
                for lane in range(32):
                    for c in range(lane, chunks, 32):
                        k0 = c * 32
                        g = k0 // GS
                        for r in range(RR):
                            n = n0 + r % R
                            w, sc, bs = ws[1] if (ACT and r >= R) else ws[0]
                            wq = w[e, n, c * 4 : c * 4 + 4]  # the uint4 at c
                            q = np.array(
                                [(int(wq[j]) >> (4 * i)) & 0xF for j in range(4) for i in range(8)],
                                np.float64,
                            )
                            for m in range(mc):
                                xv = x[rows[m], k0 : k0 + 32].astype(np.float64)
                                d = (xv * q).sum()
                                acc[lane, m, r] += sc[e, n, g] * d + bs[e, n, g] * xv.sum()
                tot = acc.sum(axis=0)
                for m in range(mc):
                    for r in range(R):
                        v = tot[m, r]
                        if ACT:
                            gate, up = v, tot[m, RR - R + r]
                            v = (
                                gate / (1 + np.exp(-gate)) * up
                                if ACT == 1
                                else (
                                    0.5
                                    * gate
                                    * (
                                        1
                                        + np.tanh(0.7978845608028654 * (gate + 0.044715 * gate**3))
                                    )
                                    * up
                                )
                            )
                        y[pairs[m0 + m], n0 + r] = v
    return y


def quantized(rng, e, n, k, gs):
    w = rng.integers(0, 2**32, size=(e, n, k // 8), dtype=np.uint64).astype(np.uint32)
    sc = rng.uniform(0.01, 0.05, size=(e, n, k // gs)).astype(np.float32)
    bs = -8 * sc + rng.uniform(-0.01, 0.01, size=sc.shape).astype(np.float32)
    return w, sc, bs


def dequant(w, sc, bs, gs):
    e, n, words = w.shape
    q = ((w[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).reshape(e, n, words * 8)
    return q * np.repeat(sc, gs, axis=-1) + np.repeat(bs, gs, axis=-1)


def case(tokens, top_k, experts, d, inter, gs, act, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    idx = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    idx = idx.reshape(-1).astype(np.uint32)
    gate, up, down = (quantized(rng, experts, inter, d, gs), quantized(rng, experts, inter, d, gs),
                      quantized(rng, experts, d, inter, gs))  # fmt: skip
    mmax = gpu_moe._mmax(tokens)
    errs = []
    for kind, inp, ws, n, div, a in (
        ("glu", x, [gate, up], inter, top_k, gpu_moe.ACTIVATIONS[act]),
        ("product", None, [down], d, 1, 0),
    ):
        glu = kind == "glu"
        r = gpu_moe._rows(n, mmax, glu)
        tmpl = dict(R=r, RR=2 * r if glu else r, WARPS=gpu_moe.WARPS, MMAX=mmax, DIV=div,
                    ACT=a, LCAP=gpu_moe.MAX_TOKENS, GS=gs)  # fmt: skip
        tiles = -(-n // (gpu_moe.WARPS * r))
        slots = min(idx.shape[0], experts)
        if glu:
            got = run_kernel(kind, inp, idx, ws, tmpl, slots, tiles)
            xr = x[np.arange(idx.shape[0]) // top_k].astype(np.float64)
            g = np.einsum("pk,pnk->pn", xr, dequant(*gate, gs)[idx])
            u = np.einsum("pk,pnk->pn", xr, dequant(*up, gs)[idx])
            act_g = (
                g / (1 + np.exp(-g))
                if a == 1
                else (0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))))
            )
            want = act_g * u
            h = got
        else:
            got = run_kernel(kind, h, idx, ws, tmpl, slots, tiles)
            want = np.einsum("pk,pnk->pn", h.astype(np.float64), dequant(*down, gs)[idx])
        errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
    return errs


def main() -> None:
    worst = 0.0
    for tokens, top_k, experts, d, inter, gs, act in (
        (1, 2, 8, 64, 32, 32, "silu"),
        (5, 2, 8, 128, 64, 64, "gelu_tanh"),
        (3, 3, 40, 64, 96, 32, "silu"),
        (20, 2, 4, 96, 32, 32, "silu"),
    ):
        errs = case(tokens, top_k, experts, d, inter, gs, act, seed=tokens)
        worst = max(worst, *errs)
        print(f"T={tokens} k={top_k} E={experts} D={d} I={inter} gs={gs} {act}: "
              f"glu {errs[0]:.2e} down {errs[1]:.2e}")  # fmt: skip
    sys.exit(0 if worst < 1e-5 else 1)


if __name__ == "__main__":
    main()
