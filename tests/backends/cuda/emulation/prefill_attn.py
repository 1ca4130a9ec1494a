"""engine/backends/cuda/attention/prefill.py's kernel, lane by lane in numpy (no GPU).

Device time is scarce, so the kernel's index logic (which lane holds which query row,
key and head-dim column in each ``mma.sync.m16n8k16`` fragment, the causal limit, the
reversed block order, the score accumulators reused as the next MMA's A operand) is
transcribed here statement by statement, with each MMA done by gathering the 32
lanes' registers into the matrices the PTX ISA's fragment layouts say they hold.
It is checked against plain causal attention for the shapes of
tests/backends/cuda/test_gpu_prefill_attention.py. Rounding to bf16 is left out (float64
throughout): this checks the indices, the GPU test checks the numbers.

    .venv/bin/python bench/gpu/prefill_attn_emulation.py
"""

from __future__ import annotations

import numpy as np

from engine.backends.cuda.attention.prefill import BLOCK_K as BK
from engine.backends.cuda.attention.prefill import BLOCK_Q as BQ
from tests.backends.cuda.test_gpu_prefill_attention import causal_attention as reference


def a_regs(lane_val):
    """lane -> 4 registers of 2 values each, from a function (row, col) of the 16x16 A."""
    return [
        [
            (lane_val(g, 2 * t), lane_val(g, 2 * t + 1)),
            (lane_val(g + 8, 2 * t), lane_val(g + 8, 2 * t + 1)),
            (lane_val(g, 2 * t + 8), lane_val(g, 2 * t + 9)),
            (lane_val(g + 8, 2 * t + 8), lane_val(g + 8, 2 * t + 9)),
        ]
        for g, t in (divmod(lane, 4) for lane in range(32))
    ]


def mma(c, a, b):
    """c[lane][4] += A @ B, with A given as every lane's 4 A registers and B as every
    lane's 2 B registers (PTX ISA, mma.m16n8k16 fragment layouts)."""
    am = np.zeros((16, 16))
    bm = np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        r = a[lane]
        am[g, 2 * t : 2 * t + 2] = r[0]
        am[g + 8, 2 * t : 2 * t + 2] = r[1]
        am[g, 2 * t + 8 : 2 * t + 10] = r[2]
        am[g + 8, 2 * t + 8 : 2 * t + 10] = r[3]
        b0, b1 = b[lane]
        bm[2 * t : 2 * t + 2, g] = b0
        bm[2 * t + 8 : 2 * t + 10, g] = b1
    cm = am @ bm
    for lane in range(32):
        g, t = divmod(lane, 4)
        c[lane] += [cm[g, 2 * t], cm[g, 2 * t + 1], cm[g + 8, 2 * t], cm[g + 8, 2 * t + 1]]


def ldm4(smem, addr, trans):
    """``ldmatrix.x4`` (``.trans``): lane l names (row, col) of row l % 8 of matrix l // 8
    (8 consecutive elements); lane l gets for each matrix i the pair an MMA fragment
    holds: (M[l//4][2(l%4)], M[l//4][2(l%4)+1]), of M's transpose with .trans."""
    mats = []
    for i in range(4):
        rows = []
        for r in range(8):
            row, col = addr(8 * i + r)
            rows.append(smem[row, col : col + 8])
        mats.append(np.array(rows))
    out = []
    for lane in range(32):
        g, t = divmod(lane, 4)
        regs = []
        for m in mats:
            mm = m.T if trans else m
            regs.append(mm[g, 2 * t : 2 * t + 2])
        out.append(regs)
    return out


def kernel(q, k, v, scale, ldm=False):
    """The CUDA source's statements for every block, warp and lane (``ldm``: the
    fragments by ldmatrix, as with the kernel's LDM)."""
    b_n, n_q, lq, hd = q.shape
    n_kv, s_len = k.shape[1], k.shape[2]
    ks_n, dt = hd // 16, hd // 8
    out = np.full(q.shape, np.nan)
    blocks = (lq + BQ - 1) // BQ
    sl2 = scale * np.log2(np.e)
    for b in range(b_n):
        for hq in range(n_q):
            hkv = hq // (n_q // n_kv)
            for bx in range(blocks):
                q0 = (blocks - 1 - bx) * BQ
                diag = s_len - lq
                last_key = diag + min(lq - 1, q0 + BQ - 1)
                ntiles = last_key // BK + 1
                for warp in range(4):
                    r_lo = q0 + warp * 16
                    if r_lo >= lq:
                        continue
                    w_last = diag + min(lq - 1, r_lo + 15)
                    rows = q[b, hq, np.minimum(r_lo + np.arange(16), lq - 1)]  # clamped
                    qf = [
                        a_regs(lambda r, c, kk=kk, rows=rows: rows[r, kk * 16 + c])
                        for kk in range(ks_n)
                    ]
                    m = np.full((32, 2), -np.inf)
                    lsum = np.zeros((32, 2))
                    o = np.zeros((dt, 32, 4))
                    for kt in range(ntiles):
                        k0 = kt * BK
                        ks = np.zeros((BK, hd))
                        vs = np.zeros((BK, hd))
                        n = max(0, min(BK, s_len - k0))
                        ks[:n], vs[:n] = k[b, hkv, k0 : k0 + n], v[b, hkv, k0 : k0 + n]
                        if k0 > w_last:
                            continue
                        s = np.zeros((BK // 8, 32, 4))
                        for j in range(BK // 8):
                            if ldm:
                                for kk in range(0, ks_n, 2):
                                    r = ldm4(
                                        ks,
                                        lambda ln, j=j, kk=kk: (
                                            j * 8 + (ln & 7),
                                            (ln >> 3) * 8 + kk * 16,
                                        ),
                                        False,
                                    )
                                    mma(s[j], qf[kk], [(x[0], x[1]) for x in r])
                                    mma(s[j], qf[kk + 1], [(x[2], x[3]) for x in r])
                                continue
                            for kk in range(ks_n):
                                bregs = []
                                for lane in range(32):
                                    g, t = divmod(lane, 4)
                                    row = ks[j * 8 + g]
                                    c = kk * 16 + 2 * t
                                    bregs.append((row[c : c + 2], row[c + 8 : c + 10]))
                                mma(s[j], [qf[kk][lane] for lane in range(32)], bregs)
                        masked = k0 + BK - 1 > diag + r_lo
                        s *= sl2
                        for lane in range(32):
                            g, t = divmod(lane, 4)
                            for j in range(BK // 8):
                                for e in range(4):
                                    key = k0 + j * 8 + 2 * t + (e & 1)
                                    row = r_lo + g + (e >> 1) * 8
                                    if masked and key > min(diag + row, s_len - 1):
                                        s[j, lane, e] = -np.inf
                        # row max over the quad (lanes 4g..4g+3)
                        mx_ = np.stack(
                            [s[:, :, 0:2].max(axis=(0, 2)), s[:, :, 2:4].max(axis=(0, 2))], 1
                        )
                        quad = mx_.reshape(8, 4, 2).max(axis=1)
                        mx_ = np.repeat(quad, 4, axis=0)
                        new = np.maximum(m, mx_)
                        z = np.where(new == -np.inf, 0.0, new)
                        alpha = np.exp2(m - z)
                        m = new
                        lsum *= alpha
                        o[:, :, 0:2] *= alpha[None, :, 0:1]
                        o[:, :, 2:4] *= alpha[None, :, 1:2]
                        p = np.exp2(s - np.concatenate([z[:, :1]] * 2 + [z[:, 1:]] * 2, 1)[None])
                        lsum[:, 0] += p[:, :, 0:2].sum(axis=(0, 2))
                        lsum[:, 1] += p[:, :, 2:4].sum(axis=(0, 2))
                        for kk in range(BK // 16):
                            aregs = [
                                [
                                    p[2 * kk, lane, 0:2],
                                    p[2 * kk, lane, 2:4],
                                    p[2 * kk + 1, lane, 0:2],
                                    p[2 * kk + 1, lane, 2:4],
                                ]
                                for lane in range(32)
                            ]
                            if ldm:
                                for d in range(0, dt, 2):
                                    r = ldm4(
                                        vs,
                                        lambda ln, kk=kk, d=d: (
                                            kk * 16 + (ln & 7) + ((ln >> 3) & 1) * 8,
                                            (ln >> 4) * 8 + d * 8,
                                        ),
                                        True,
                                    )
                                    mma(o[d], aregs, [(x[0], x[1]) for x in r])
                                    mma(o[d + 1], aregs, [(x[2], x[3]) for x in r])
                                continue
                            for d in range(dt):
                                bregs = []
                                for lane in range(32):
                                    g, t = divmod(lane, 4)
                                    r0 = kk * 16 + 2 * t
                                    col = d * 8 + g
                                    bregs.append((vs[r0 : r0 + 2, col], vs[r0 + 8 : r0 + 10, col]))
                                mma(o[d], aregs, bregs)
                    tot = lsum.reshape(8, 4, 2).sum(axis=1)
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        for half, ra in ((0, r_lo + g), (1, r_lo + g + 8)):
                            if ra >= lq:
                                continue
                            for d in range(dt):
                                c = d * 8 + 2 * t
                                out[b, hq, ra, c : c + 2] = (
                                    o[d, lane, 2 * half : 2 * half + 2] / (tot[g, half])
                                )
    return out


def main() -> None:
    rng = np.random.default_rng(0)
    cases = [(1, 2, 1, 2, 2, 64), (1, 2, 2, 17, 17, 128), (1, 2, 1, 70, 135, 64)]
    cases += [(2, 2, 1, 100, 229, 64), (1, 1, 1, 130, 130, 64)]
    for b, hq, hkv, lq, s, d in cases:
        q = rng.standard_normal((b, hq, lq, d))
        k = rng.standard_normal((b, hkv, s, d))
        v = rng.standard_normal((b, hkv, s, d))
        for ldm in (False, True):
            got = kernel(q, k, v, d**-0.5, ldm=ldm)
            err = np.abs(got - reference(q, k, v, d**-0.5)).max()
            print(f"b={b} hq={hq} hkv={hkv} L={lq} S={s} D={d} ldm={ldm}: max abs error {err:.2e}")
            assert err < 1e-9, err
    print("ok")


if __name__ == "__main__":
    main()
