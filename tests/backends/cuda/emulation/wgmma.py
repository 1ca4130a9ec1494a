"""engine/backends/cuda/products/wgmma.py's addressing, transcribed to numpy: where each thread writes the
dequantized weights and copies x in shared memory, where ``wgmma`` reads its operands
from by descriptor (start address, leading offset between 8-input core-matrix
columns, stride offset between 8-row groups: the canonical K-major layout without
swizzle, as the PTX ISA gives it), the accumulator fragment each thread holds, split K
and the epilogues. It checks that the kernel's writers and readers agree and that the
outputs land where they belong; what it cannot check is the hardware's reading of the
descriptor, which bench/gpu/wgmma_bench.py's exactness table does on the GPU (both
readings, ``MARKBASE_GPU_WGMMA_SWAP``).

    .venv/bin/python bench/gpu/wgmma_emulation.py   (also run by tests/backends/cuda/test_gpu_wgmma.py)
"""

from __future__ import annotations

import numpy as np

KS, NA, PAD = 64, 3, 16


def run(x, q, s, b, gs, glu=False, res=None, bn=128, wgs=2, nx=3, splits=1, swap=False):
    """y as the kernel computes it for x [M, K], 4-bit values q [NW, K], scales and
    biases [NW, K / gs] (float64 throughout: the layout, not the rounding)."""
    m_rows, k = x.shape
    nw = q.shape[0]
    n_out = nw // 2 if glu else nw
    rb, nt = 64 * wgs, 128 * wgs
    albo, xlbo = rb // 8 * 128 + PAD, bn // 8 * 128 + PAD
    asz, xsz = 8 * albo, 8 * xlbo
    lbo_a, sbo_a = (128, albo) if swap else (albo, 128)
    lbo_x, sbo_x = (128, xlbo) if swap else (xlbo, 128)
    steps = k // KS
    tcount = n_out // (rb // 2) if glu else nw // rb
    rc = -(-m_rows // bn)
    tiles = tcount * rc
    wd = q * np.repeat(s, gs, axis=1) + np.repeat(b, gs, axis=1)
    y = np.full((m_rows, n_out), np.nan)
    tid = np.arange(nt)
    r, h = tid >> 1, tid & 1
    wq, lane = (tid % 128) // 32, tid % 32
    g, t = lane >> 2, lane & 3
    wg = tid // 128
    parts = {}
    for blk in range(tiles * splits):
        tl, sp = blk % tiles, blk // tiles
        tc, m0 = tl // rc, (tl % rc) * bn
        k0, k1 = steps * sp // splits, steps * (sp + 1) // splits
        if glu:
            o = tc * (rb // 2) + (r >> 4) * 8 + (r & 7)
            wr = np.where(r & 8, n_out + o, o)
        else:
            wr = tc * rb + r
        smem = np.full((NA * asz + nx * xsz) // 2, np.nan)  # 2-byte elements
        acc = np.zeros((wgs, 64, bn))
        for i, ks in enumerate(range(k0, k1)):
            sa, sx = i % NA, i % nx
            # the threads' dequantized runs: core column 4h + j, row r
            for j in range(4):
                addr = sa * asz + (4 * h + j) * albo + (r >> 3) * 128 + (r & 7) * 16
                cols = ks * KS + 32 * h + 8 * j
                for e in range(8):
                    smem[(addr + 2 * e) // 2] = wd[wr, cols + e]
            # x's copies: unit it * nt + tid = row n, inputs 8 kc..
            kc = tid & 7
            for it in range(bn * 8 // nt):
                n = it * (nt // 8) + (tid >> 3)
                addr = NA * asz + sx * xsz + kc * xlbo + (n >> 3) * 128 + (n & 7) * 16
                ok = m0 + n < m_rows
                for e in range(8):
                    val = np.where(ok, x[np.minimum(m0 + n, m_rows - 1), ks * KS + kc * 8 + e], 0.0)
                    smem[(addr + 2 * e) // 2] = val
            # each warpgroup's 4 wgmma: A 64 x 16 and B 16 x bn by descriptor
            mm, kk = np.meshgrid(np.arange(64), np.arange(16), indexing="ij")
            kb, nn = np.meshgrid(np.arange(16), np.arange(bn), indexing="ij")
            for w in range(wgs):
                for s4 in range(4):
                    a0 = sa * asz + 2 * s4 * albo + w * 8 * 128
                    ea = a0 + (kk // 8) * lbo_a + (mm // 8) * sbo_a + (mm % 8) * 16 + (kk % 8) * 2
                    x0 = NA * asz + sx * xsz + 2 * s4 * xlbo
                    eb = x0 + (kb // 8) * lbo_x + (nn // 8) * sbo_x + (nn % 8) * 16 + (kb % 8) * 2
                    acc[w] += smem[ea // 2] @ smem[eb // 2]
        # the fragments: warp wq holds rows 16 wq + g (d[4j], d[4j+1]) and + 8, x rows
        # 8j + 2t (+1)
        d = np.zeros((nt, bn // 2))
        for jj in range(bn // 8):
            for e in range(2):
                d[:, 4 * jj + e] = acc[wg, 16 * wq + g, 8 * jj + 2 * t + e]
                d[:, 4 * jj + 2 + e] = acc[wg, 16 * wq + g + 8, 8 * jj + 2 * t + e]
        if splits > 1:
            parts[blk] = d
            if len([p for p in parts if p % tiles == tl]) < splits:
                continue  # not the tile's last block
            d = sum(parts[s2 * tiles + tl] for s2 in range(splits))
        r0 = wg * 64 + wq * 16 + g
        for jj in range(bn // 8):
            for e in range(2):
                m = m0 + jj * 8 + 2 * t + e
                ok = m < m_rows
                if glu:
                    col = tc * (rb // 2) + (wg * 4 + wq) * 8 + g
                    gate, up = d[:, 4 * jj + e], d[:, 4 * jj + 2 + e]
                    y[m[ok], col[ok]] = (gate / (1 + np.exp(-gate)) * up)[ok]
                else:
                    row0 = tc * rb + r0
                    for rr, v in ((row0, d[:, 4 * jj + e]), (row0 + 8, d[:, 4 * jj + 2 + e])):
                        extra = res[np.minimum(m, m_rows - 1), rr] if res is not None else 0.0
                        y[m[ok], rr[ok]] = (v + extra)[ok]
    return y


def main() -> None:
    rng = np.random.default_rng(0)
    cases = [(128, 256, 128, 64, 2, 1), (40, 256, 192, 32, 2, 3), (130, 512, 256, 64, 4, 2),
             (70, 256, 128, 128, 2, 1)]  # fmt: skip
    for m, nw, k, gs, wgs, sp in cases:
        x = 0.1 * rng.standard_normal((m, k))
        q = rng.integers(0, 16, (nw, k)).astype(float)
        s, b = 0.1 * rng.standard_normal((nw, k // gs)), 0.1 * rng.standard_normal((nw, k // gs))
        wd = q * np.repeat(s, gs, axis=1) + np.repeat(b, gs, axis=1)
        res = rng.standard_normal((m, nw))
        bn = 64 if m <= 64 else 128
        for nx in (3, 4, 5):
            got = run(x, q, s, b, gs, bn=bn, wgs=wgs, nx=nx, splits=sp)
            np.testing.assert_allclose(got, x @ wd.T, atol=1e-9)
            got = run(x, q, s, b, gs, res=res, bn=bn, wgs=wgs, nx=nx, splits=sp)
            np.testing.assert_allclose(got, res + x @ wd.T, atol=1e-9)
            gate, up = x @ wd[: nw // 2].T, x @ wd[nw // 2 :].T
            got = run(x, q, s, b, gs, glu=True, bn=bn, wgs=wgs, nx=nx, splits=sp)
            np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, atol=1e-9)
        print(f"rows {m} N {nw} K {k} gs {gs} warpgroups {wgs} splits {sp}: equal")


if __name__ == "__main__":
    main()
