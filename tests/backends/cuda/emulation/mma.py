"""engine/backends/cuda/products/mma.py's index logic, lane by lane, in numpy: a CPU check of the layout.

Each function transcribes the CUDA source's loads, its ``mma.sync.m16n8k16`` fragment
use (the PTX ISA's layouts for A row-major 16x16, B column-major 16x8, C 16x8) and its
epilogue (shared-memory sum over warps, residual, GLU) for one block at a time, then
compares with numpy's product. It checks the mapping, not the CUDA code itself: change
both together. Used  before the first GPU run (the kernels then passed
every test at their first run) and for the GLU epilogue, whose GPU test had not run.

    .venv/bin/python bench/gpu/mma_emulation.py
"""

from __future__ import annotations

import numpy as np


def mma(c, A_regs, B_regs):
    # A_regs[lane] = 4 pairs, B_regs[lane] = 2 pairs (pairs = (lo, hi) floats)
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        r0, r1, r2, r3 = A_regs[lane]
        A[g, 2 * t : 2 * t + 2] = r0
        A[g + 8, 2 * t : 2 * t + 2] = r1
        A[g, 2 * t + 8 : 2 * t + 10] = r2
        A[g + 8, 2 * t + 8 : 2 * t + 10] = r3
        b0, b1 = B_regs[lane]
        B[2 * t : 2 * t + 2, g] = b0
        B[2 * t + 8 : 2 * t + 10, g] = b1
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += np.array([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])


def words(vec8):  # uint4 of 8 elems -> 4 pairs
    return [vec8[0:2], vec8[2:4], vec8[4:6], vec8[6:8]]


def tiles(NW, MT, GLU):
    """(block, m-tile, first output feature of the m-tile) as the kernel's n0/nb."""
    for blk in range(NW // (16 * MT)):
        for mt in range(MT):
            yield blk, mt, blk * (8 if GLU else 16) * MT + mt * (8 if GLU else 16)


def run_float(x, w, NT, U, WARPS, GLU, r=None, MT=1, norm=None):
    """``norm`` = (weight [K], eps): the NORM form (x through RMSNorm first)."""
    M, K = x.shape
    NW = w.shape[0]
    N = NW // 2 if GLU else NW
    y = np.zeros((M, N))
    for _blk, _mt, n0 in tiles(NW, MT, GLU):
        red = np.zeros((WARPS, NT, 4, 32))
        ss = np.zeros((WARPS, NT, 32))  # each lane's sum of squares of its row's x
        for warp in range(WARPS):
            c = np.zeros((NT, 32, 4))
            chunks = K // 8
            s = warp
            while s * 4 * U < chunks:
                for u in range(U):
                    A = []
                    Bs = [[] for _ in range(NT)]
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        row0 = n0 + g
                        row1 = N + n0 + g if GLU else n0 + g + 8
                        off = ((s * U + u) * 4 + t) * 8
                        A.append((words(w[row0, off : off + 8]), words(w[row1, off : off + 8])))
                        for j in range(NT):
                            m = j * 8 + g
                            xs = x[m, off : off + 8] if m < M else np.zeros(8)
                            if norm is not None:
                                ss[warp, j, lane] += (xs * xs).sum()
                                xs = xs * norm[0][off : off + 8]
                            Bs[j].append(words(xs))
                    for j in range(NT):
                        for h in range(2):
                            Ar = [
                                (
                                    A[ln][0][2 * h],
                                    A[ln][1][2 * h],
                                    A[ln][0][2 * h + 1],
                                    A[ln][1][2 * h + 1],
                                )
                                for ln in range(32)
                            ]
                            Br = [(Bs[j][ln][2 * h], Bs[j][ln][2 * h + 1]) for ln in range(32)]
                            mma(c[j], Ar, Br)
                s += WARPS
            for j in range(NT):
                for i in range(4):
                    red[warp, j, i] = c[j, :, i]
        flat = red.reshape(WARPS, NT * 128)  # index (j*4+i)*32 + l
        rs = np.ones(NT * 8)
        if norm is not None:  # quad shuffles (lanes 4g..4g+3), then the warps
            quad = ss.reshape(WARPS, NT, 8, 4).sum(axis=3)  # [warp, j, g]
            rs = 1 / np.sqrt(quad.sum(axis=0).reshape(NT * 8) / K + norm[1])
        if GLU:
            for e in range(NT * 64):
                j, i, ln = e >> 6, (e >> 5) & 1, e & 31
                gs = flat[:, (j * 4 + i) * 32 + ln].sum()
                us = flat[:, (j * 4 + i + 2) * 32 + ln].sum()
                m = j * 8 + (ln & 3) * 2 + i
                gs, us = gs * rs[m], us * rs[m]
                if m < M:
                    y[m, n0 + (ln >> 2)] = gs / (1 + np.exp(-gs)) * us
        else:
            for e in range(NT * 128):
                v = flat[:, e].sum()
                j, i, ln = e >> 7, (e >> 5) & 3, e & 31
                n = n0 + (ln >> 2) + (8 if i >= 2 else 0)
                m = j * 8 + (ln & 3) * 2 + (i & 1)
                v *= rs[m]
                if m < M:
                    y[m, n] = v + (r[m, n] if r is not None else 0)
    return y


def run_q4(x, q, s_, b_, GS, NT, U, WARPS, MT=1):
    # q: [N, K] ints 0..15 (unpacked); emulate word/nibble extraction via packing
    M, K = x.shape
    N = q.shape[0]
    packed = np.zeros((N, K // 8), dtype=np.uint64)
    for i in range(8):
        packed |= q[:, i::8].astype(np.uint64) << np.uint64(4 * i)
    y = np.zeros((M, N))

    def nib(word, sh):
        return (int(word) >> sh) & 0xF

    for _blk, _mt, n0 in tiles(N, MT, False):
        red = np.zeros((WARPS, NT, 32, 4))
        for warp in range(WARPS):
            c = np.zeros((NT, 32, 4))
            chunks = K // 32
            sidx = warp
            while sidx * 4 * U < chunks:
                for u in range(U):
                    per_lane = []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        ch = (sidx * U + u) * 4 + t
                        q0 = packed[n0 + g, ch * 4 : ch * 4 + 4]
                        q1 = packed[n0 + g + 8, ch * 4 : ch * 4 + 4]
                        gi = ch * 32 // GS
                        xb = []
                        for j in range(NT):
                            m = j * 8 + g
                            xb.append(x[m, ch * 32 : ch * 32 + 32] if m < M else np.zeros(32))
                        per_lane.append((q0, q1, gi, g, xb))
                    for h in range(8):
                        Ar = []
                        Brs = [[] for _ in range(NT)]
                        for lane in range(32):
                            q0, q1, gi, g, xb = per_lane[lane]
                            v0 = int(q0[h >> 1]) >> ((h & 1) * 16)
                            v1 = int(q1[h >> 1]) >> ((h & 1) * 16)

                            def deq(v, row, gi=gi):
                                return np.array([nib(v, 0), nib(v, 4)]) * s_[row, gi] + b_[row, gi]

                            Ar.append(
                                (
                                    deq(v0, n0 + g),
                                    deq(v1, n0 + g + 8),
                                    deq(v0 >> 8, n0 + g),
                                    deq(v1 >> 8, n0 + g + 8),
                                )
                            )
                            for j in range(NT):
                                blk8 = xb[j][(h >> 1) * 8 : (h >> 1) * 8 + 8]
                                wds = words(blk8)
                                x0 = wds[2] if (h & 1) else wds[0]
                                x1 = wds[3] if (h & 1) else wds[1]
                                Brs[j].append((x0, x1))
                        for j in range(NT):
                            mma(c[j], Ar, Brs[j])
                sidx += WARPS
            red[warp] = c
        tot = red.sum(0)
        for j in range(NT):
            for ln in range(32):
                for i in range(4):
                    n = n0 + (ln >> 2) + (8 if i >= 2 else 0)
                    m = j * 8 + (ln & 3) * 2 + (i & 1)
                    if m < M:
                        y[m, n] = tot[j, ln, i]
    return y


def main() -> None:
    rng = np.random.default_rng(0)
    worst = 0.0
    for m, nw, k, nt, u, warps, mt in [(3, 32, 256, 1, 2, 2, 1), (9, 16, 128, 2, 4, 1, 1),
                                       (20, 32, 64, 4, 1, 2, 1), (12, 48, 128, 2, 1, 3, 1),
                                       (5, 128, 128, 1, 1, 2, 4), (20, 64, 64, 4, 1, 1, 2),
                                       (30, 128, 128, 4, 1, 2, 2)]:  # fmt: skip
        x, w = rng.standard_normal((m, k)), rng.standard_normal((nw, k))
        r = rng.standard_normal((m, nw))
        err = np.abs(run_float(x, w, nt, u, warps, False, MT=mt) - x @ w.T).max()
        err_r = np.abs(run_float(x, w, nt, u, warps, False, r, MT=mt) - (r + x @ w.T)).max()
        gate, up = x @ w[: nw // 2].T, x @ w[nw // 2 :].T
        glu = run_float(x, w, nt, u, warps, True, MT=mt)
        err_g = np.abs(glu - gate / (1 + np.exp(-gate)) * up).max()
        g_w, eps = rng.standard_normal(k), 1e-5
        xn = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * g_w
        err_n = np.abs(run_float(x, w, nt, u, warps, False, MT=mt, norm=(g_w, eps)) - xn @ w.T)
        gate, up = xn @ w[: nw // 2].T, xn @ w[nw // 2 :].T
        glu_n = run_float(x, w, nt, u, warps, True, MT=mt, norm=(g_w, eps))
        err_gn = np.abs(glu_n - gate / (1 + np.exp(-gate)) * up).max()
        print(
            f"float m={m:2d} nt={nt} u={u} mt={mt}: plain {err:.1e}  residual {err_r:.1e}"
            f"  glu {err_g:.1e}  norm {err_n.max():.1e}  glu+norm {err_gn:.1e}"
        )
        worst = max(worst, err_n.max(), err_gn)
        worst = max(worst, err, err_r, err_g)
    for m, n, k, nt, u, warps, gs, mt in [(3, 16, 256, 1, 2, 1, 64, 1),
                                          (10, 32, 256, 2, 1, 2, 32, 1),
                                          (17, 16, 512, 4, 1, 1, 128, 1),
                                          (9, 64, 256, 2, 1, 1, 64, 4)]:  # fmt: skip
        x, q = rng.standard_normal((m, k)), rng.integers(0, 16, (n, k))
        s, b = rng.standard_normal((n, k // gs)), rng.standard_normal((n, k // gs))
        wd = q * np.repeat(s, gs, axis=1) + np.repeat(b, gs, axis=1)
        err = np.abs(run_q4(x, q, s, b, gs, nt, u, warps, MT=mt) - x @ wd.T).max()
        print(f"4-bit m={m:2d} nt={nt} u={u} mt={mt} group {gs}: {err:.1e}")
        worst = max(worst, err)
    print("ok" if worst < 1e-9 else "MISMATCH")
    raise SystemExit(0 if worst < 1e-9 else 1)


if __name__ == "__main__":
    main()
