"""engine/backends/cuda/products/qstream.py's tensor-core form, lane by lane, in numpy: a CPU check of
its index logic (which k of which group each lane's A and B pairs hold, the x pair
layout, the per-group scale and bias on C's columns, the quad sum and the epilogue).

It transcribes the kernel's loads and ``mma.sync.m16n8k16`` use for one warp and
m-tile at a time (bench/gpu/mma_emulation.py's fragment layouts) and compares with
numpy's product of the dequantized weight. It checks the mapping, not the CUDA code:
change both together.

    .venv/bin/python bench/gpu/qstream_emulation.py
"""

from __future__ import annotations

import numpy as np

from tests.backends.cuda.emulation.mma import mma

QOFF = 128.0  # bf16's exponent-trick constant (the LOP3 gives 128 + q)


def pack_rows(q: np.ndarray) -> np.ndarray:
    """4-bit values [N, K] -> MLX's words [N, K/8] (value i at bits 4(i % 8))."""
    n, k = q.shape
    w = np.zeros((n, k // 8), dtype=np.uint64)
    for i in range(8):
        w |= q[:, i::8].astype(np.uint64) << (4 * i)
    return w.astype(np.uint32)


def lop3_pair(word: int, sh: int) -> tuple[float, float]:
    """((word >> 4 sh) & 0x000F000F) | magic as the bf16 pair (lo, hi) it encodes."""
    v = (int(word) >> (4 * sh)) & 0x000F000F
    return (QOFF + (v & 0xF), QOFF + ((v >> 16) & 0xF))


def x_pairs(x: np.ndarray, gs: int) -> np.ndarray:
    """The kernel's shared-memory x: group j's word m = (x[8(m/4) + m%4], x[... + 4])."""
    ng = x.size // gs
    out = np.zeros((ng, gs // 2, 2))
    for j in range(ng):
        for m in range(gs // 2):
            wd, sh = divmod(m, 4)
            base = j * gs + 8 * wd + sh
            out[j, m] = (x[base], x[base + 4])
    return out


def run(x, w, scales, biases, gs, glu=False, r=None):
    k = x.size
    nw = w.shape[0]
    n = nw // 2 if glu else nw
    ng, gw = k // gs, gs // 8
    xp, xsum = x_pairs(x, gs), x.reshape(ng, gs).sum(axis=1)
    y = np.zeros(n)
    for u in range(n // 8 if glu else n // 16):
        acc = np.zeros((32, 2))
        for kb in range(ng // 8):
            c = np.zeros((32, 4))
            for wd in range(gw):
                for sh in range(4):
                    A, B = [], []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        r0 = u * 8 + g if glu else u * 16 + g
                        r1 = n + u * 8 + g if glu else u * 16 + g + 8
                        grp = [kb * 8 + t, kb * 8 + t + 4]
                        word = [[w[rr, gg * gw + wd] for gg in grp] for rr in (r0, r1)]
                        A.append([lop3_pair(word[0][0], sh), lop3_pair(word[1][0], sh),
                                  lop3_pair(word[0][1], sh), lop3_pair(word[1][1], sh)])  # fmt: skip
                        b0 = xp[kb * 8 + g, 4 * wd + sh] if g == t else (0.0, 0.0)
                        b1 = xp[kb * 8 + g, 4 * wd + sh] if g == t + 4 else (0.0, 0.0)
                        B.append([b0, b1])
                    mma(c, A, B)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                r0 = u * 8 + g if glu else u * 16 + g
                r1 = n + u * 8 + g if glu else u * 16 + g + 8
                ga, gb = kb * 8 + 2 * t, kb * 8 + 2 * t + 1
                for i, (row, col) in enumerate(((r0, ga), (r0, gb), (r1, ga), (r1, gb))):
                    s, b = scales[row, col], biases[row, col]
                    acc[lane, i // 2] += s * c[lane, i] + xsum[col] * (b - QOFF * s)
        for g in range(8):  # the quad's lanes 4g..4g+3 add up; lane t == 0 writes
            a0, a1 = acc[4 * g : 4 * g + 4].sum(axis=0)
            if glu:
                y[u * 8 + g] = a0 / (1 + np.exp(-a0)) * a1
            else:
                y[u * 16 + g], y[u * 16 + g + 8] = a0, a1
    return y if r is None else y + r


def main() -> None:
    rng = np.random.default_rng(0)
    for gs, nw, k, glu, res in ((64, 32, 512, False, False), (32, 16, 256, False, True),
                                (128, 32, 1024, True, False)):  # fmt: skip
        q = rng.integers(0, 16, (nw, k))
        scales = rng.standard_normal((nw, k // gs)) / 10
        biases = rng.standard_normal((nw, k // gs)) / 10
        x = rng.standard_normal(k)
        deq = q * np.repeat(scales, gs, axis=1) + np.repeat(biases, gs, axis=1)
        r = rng.standard_normal(nw) if res else None
        got = run(x, pack_rows(q), scales, biases, gs, glu, r)
        want = deq @ x
        if glu:
            gate, up = want[: nw // 2], want[nw // 2 :]
            want = gate / (1 + np.exp(-gate)) * up
        if r is not None:
            want = want + r
        err = np.abs(got - want).max() / np.abs(want).max()
        print(f"gs {gs} rows {nw} K {k} glu {glu} residual {res}: max rel error {err:.2e}")
        assert err < 1e-9, err
    print("ok")


if __name__ == "__main__":
    main()
