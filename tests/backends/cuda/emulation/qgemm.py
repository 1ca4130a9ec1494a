"""engine/backends/cuda/products/qgemm.py's index logic, lane by lane, in numpy: a CPU check of its layout.

It transcribes the kernel for every block of a launch (and for the stream-K form,
each block's passes over parts of tiles, the partial sums, the tile counters and the
last block's sum, in several orders of the blocks): the ``cp.async`` copies of x
into the shared buffer (``MB_STAGE``: unit u -> row, inputs, destination unit), each
lane's weight words, scales and biases (``MB_WLOAD``) and their dequantized MMA
fragments, the fragment reads from the buffer, ``mma.sync.m16n8k16`` with the PTX
ISA's fragment layouts (bench/gpu/mma_emulation.py's ``mma``), and the epilogue
(residual, silu(gate) * up), then compares with numpy's product. It checks the
mapping, not the CUDA code itself: change both together.

    .venv/bin/python bench/gpu/qgemm_emulation.py
"""

from __future__ import annotations

import numpy as np

from engine.backends.cuda.products.qgemm import geometry
from tests.backends.cuda.emulation.mma import mma


def pack(q: np.ndarray) -> np.ndarray:
    """4-bit values [N, K] -> uint32 words [N, K/8] as MLX packs them (input 8i + j in
    bits 4j..4j+3 of word i)."""
    n, k = q.shape
    words = np.zeros((n, k // 8), dtype=np.uint64)
    for j in range(8):
        words |= q[:, j::8].astype(np.uint64) << np.uint64(4 * j)
    return words.astype(np.uint32)


def deq2(v: int, s: float, b: float) -> tuple[float, float]:
    """mb_deq2: bits 0-3 and 4-7 of v as the pair (q0 * s + b, q1 * s + b)."""
    return ((v & 0xF) * s + b, ((v >> 4) & 0xF) * s + b)


def run(x, words, scales, biases, gs, shape=None, residual=None, glu=False, ws=False,
        sk_grid=0, seed=0):  # fmt: skip
    """``shape`` = (x rows a block, warps a block[, m-tiles a warp]); None:
    ``geometry``'s choice. ``ws``: the weights-in-shared-memory form (``MB_STAGE_W``
    copies each warp's words and scale/bias halves; the lanes read them back).
    ``sk_grid``: the stream-K form with that many blocks (the kernel's passes, partials,
    tile counters and last-block sums), the blocks' passes run in an order drawn from
    ``seed`` (any interleaving a GPU may give)."""
    m_rows, k = x.shape
    nw = words.shape[0]
    n = nw // 2 if glu else nw
    bm, wm, mt = (tuple(shape) + (1,))[:3] if shape else geometry(m_rows, nw // 16)
    rc = -(-m_rows // bm)
    assert (nw // 16) % (wm * mt) == 0
    steps = k // 128
    tiles = nw // 16 // (wm * mt) * rc
    y = np.full((m_rows, n), np.nan)
    geo = (bm, wm, mt, rc)
    if not sk_grid:
        for block in range(tiles):
            acc = tile_pass(x, words, scales, biases, gs, n, glu, ws, geo, block, 0, steps)
            epilogue(y, acc, geo, block, n, glu, residual)
        assert not np.isnan(y).any(), "an output nobody wrote"
        return y
    # the kernel's stream-K arithmetic, as written there (int64 items, floor divisions)
    grid = sk_grid
    items = tiles * steps
    assert grid <= items, "the launch gives every block a k-step at least (stream_k_grid)"
    queues = []
    for b in range(grid):
        it0, it1 = items * b // grid, items * (b + 1) // grid
        passes, wi = [], it0
        while wi < it1:
            tl = wi // steps
            k0 = wi - tl * steps
            k1 = min(steps, k0 + (it1 - wi))
            passes.append((tl, k0, k1, wi == it0))
            wi += k1 - k0
        queues.append(passes)
    cnt = [0] * tiles
    partials = {}  # (block, slot) -> the block's accumulators of that pass
    summed = set()
    rng = np.random.default_rng(seed)
    while any(queues):
        b = int(rng.choice([i for i, q in enumerate(queues) if q]))
        tl, k0, k1, first = queues[b].pop(0)
        acc = tile_pass(x, words, scales, biases, gs, n, glu, ws, geo, tl, k0, k1)
        if k0 != 0 or k1 != steps:
            slot = 0 if first else 1
            assert (b, slot) not in partials, "two partials in one slot"
            partials[b, slot] = acc
            x0 = tl * steps
            b0 = ((x0 + 1) * grid - 1) // items
            b1 = ((x0 + steps) * grid - 1) // items
            old = cnt[tl]
            cnt[tl] += 1  # mb_last_of
            if old != b1 - b0:
                continue
            cnt[tl] = 0
            acc = {key: np.zeros_like(v) for key, v in acc.items()}
            for bb in range(b0, b1 + 1):
                sb = items * bb // grid
                part = partials[bb, 0 if sb // steps == tl else 1]
                for key in acc:
                    acc[key] = acc[key] + part[key]
            assert tl not in summed, "a tile summed twice"
            summed.add(tl)
        epilogue(y, acc, geo, tl, n, glu, residual)
    assert not any(cnt), "a counter not left at zero"
    assert not np.isnan(y).any(), "an output nobody wrote"
    return y


def tile_pass(x, words, scales, biases, gs, n, glu, ws, geo, tl, k0, k1):
    """One pass of a block: tile ``tl``'s k-steps k0..k1 - 1 (MB_STAGE, the weight
    registers or MB_STAGE_W, the fragments, the MMAs); the warps' accumulators."""
    bm, wm, mt, rc = geo
    m_rows = x.shape[0]
    ntw = bm // 8
    xu = bm * 16
    m0 = (tl % rc) * bm
    # the shared buffer of one step: 16-byte units of 8 inputs (one per stage; the
    # double buffering changes when, not where)
    # a warp's m-tiles (wt = (warp, i)): tile ((tl // rc) * wm + warp) * mt + i
    warp_tiles = [(w, i) for w in range(wm) for i in range(mt)]
    acc = {wt: np.zeros((ntw, 32, 4)) for wt in warp_tiles}
    for ks in range(k0, k1):
        xs = [None] * xu
        for u in range(xu):  # MB_STAGE
            rr, q = u >> 4, u & 15
            ok = m0 + rr < m_rows
            src = x[m0 + rr, ks * 128 + q * 8 : ks * 128 + q * 8 + 8] if ok else np.zeros(8)
            dst = (((rr >> 3) * 4 + (q & 3)) * 8 + (rr & 7)) * 4 + (q >> 2)
            assert xs[dst] is None, "two copies into one unit"
            xs[dst] = src
        assert all(v is not None for v in xs)
        staged = {w: stage_weights(words, scales, biases, gs, n, glu, tl // rc * wm + w,
                                   mt, ks) for w in range(wm)} if ws else {}  # fmt: skip
        for warp, i in warp_tiles:
            tile = ((tl // rc) * wm + warp) * mt + i
            regs = []
            if ws:
                wsd, ssd = staged[warp]
                sw = 64 // gs
                for lane in range(32):  # the WS branch's reads into cur[i]
                    g, t = lane >> 2, lane & 3
                    gl = t * 32 // gs
                    regs.append((wsd[i * 64 + g * 4 + t], wsd[i * 64 + 32 + g * 4 + t],
                                 ssd[(i * 32 + g * 2) * sw * 2 + gl],
                                 ssd[(i * 32 + (g + 8) * 2) * sw * 2 + gl],
                                 ssd[(i * 32 + g * 2 + 1) * sw * 2 + gl],
                                 ssd[(i * 32 + (g + 8) * 2 + 1) * sw * 2 + gl]))  # fmt: skip
            for lane in range(32 if not ws else 0):  # MB_WLOAD
                g, t = lane >> 2, lane & 3
                f = tile * (8 if glu else 16) + g
                row0, row1 = f, (n + f if glu else f + 8)
                gi = (ks * 128 + t * 32) // gs
                q0 = words[row0, ks * 16 + t * 4 : ks * 16 + t * 4 + 4]
                q1 = words[row1, ks * 16 + t * 4 : ks * 16 + t * 4 + 4]
                regs.append((q0, q1, scales[row0, gi], scales[row1, gi], biases[row0, gi],
                             biases[row1, gi]))  # fmt: skip
            for hp in range(4):
                a_first, a_second = [], []
                for lane in range(32):
                    q0, q1, s0, s1, b0, b1 = regs[lane]
                    v0, v1 = int(q0[hp]), int(q1[hp])
                    a_first.append((deq2(v0, s0, b0), deq2(v1, s1, b1),
                                    deq2(v0 >> 8, s0, b0), deq2(v1 >> 8, s1, b1)))  # fmt: skip
                    a_second.append((deq2(v0 >> 16, s0, b0), deq2(v1 >> 16, s1, b1),
                                     deq2(v0 >> 24, s0, b0), deq2(v1 >> 24, s1, b1)))  # fmt: skip
                for j in range(ntw):
                    xv = [xs[(j * 4 + hp) * 32 + lane] for lane in range(32)]
                    mma(acc[warp, i][j], a_first, [(v[0:2], v[2:4]) for v in xv])
                    mma(acc[warp, i][j], a_second, [(v[4:6], v[6:8]) for v in xv])
    return acc


def epilogue(y, acc, geo, tl, n, glu, residual):
    """Tile ``tl``'s outputs from the warps' accumulators (+ residual, or the SwiGLU);
    every output written once."""
    bm, wm, mt, rc = geo
    m_rows = y.shape[0]
    m0 = (tl % rc) * bm
    for warp, i in acc:
        tile = ((tl // rc) * wm + warp) * mt + i
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            f = tile * (8 if glu else 16) + g
            row0, row1 = f, (n + f if glu else f + 8)
            for j in range(bm // 8):
                c = acc[warp, i][j][lane]
                for e in range(2):
                    m = m0 + j * 8 + 2 * t + e
                    if m >= m_rows:
                        continue
                    if glu:
                        gs_, us = c[e], c[2 + e]
                        assert np.isnan(y[m, f])
                        y[m, f] = gs_ / (1 + np.exp(-gs_)) * us
                    else:
                        v0, v1 = c[e], c[2 + e]
                        if residual is not None:
                            v0, v1 = v0 + residual[m, row0], v1 + residual[m, row1]
                        assert np.isnan(y[m, row0]) and np.isnan(y[m, row1])
                        y[m, row0], y[m, row1] = v0, v1


def stage_weights(words, scales, biases, gs, n, glu, wtile0, mt, ks):
    """MB_STAGE_W for one warp (its m-tiles start at ``wtile0 * mt``) and k-step ``ks``:
    the warp's shared weight units (4 words each) and its scale/bias halves (uint16
    slots: SW words of 2 a (m-tile, MMA row, scale or bias))."""
    sw = 64 // gs
    tile0 = wtile0 * mt
    wsd = [None] * (mt * 64)
    for u in range(mt * 64):
        i, r = u >> 6, (u >> 2) & 15
        fr = (tile0 + i) * (8 if glu else 16) + (r & 7)
        row = fr if r < 8 else (n + fr if glu else fr + 8)
        assert wsd[u] is None
        wsd[u] = words[row, (u & 3) * 4 + ks * 16 : (u & 3) * 4 + ks * 16 + 4]
    ssd = [None] * (mt * 32 * sw * 2)
    for u in range(mt * 32):
        i, r = u >> 5, (u >> 1) & 15
        fr = (tile0 + i) * (8 if glu else 16) + (r & 7)
        row = fr if r < 8 else (n + fr if glu else fr + 8)
        src = biases if u & 1 else scales
        for h in range(sw * 2):  # an SW * 4-byte copy from group ks * (128 / gs)
            assert ssd[u * sw * 2 + h] is None
            ssd[u * sw * 2 + h] = src[row, ks * (128 // gs) + h]
    assert all(v is not None for v in wsd) and all(v is not None for v in ssd)
    return wsd, ssd


def problem(rng, m: int, nw: int, k: int, gs: int):
    """A random product: x [m, k], 4-bit weights of ``nw`` rows packed as MLX does, their
    scales and biases, the dequantized weight, and a residual [m, nw]."""
    x = 0.1 * rng.standard_normal((m, k))
    q = rng.integers(0, 16, (nw, k))
    s = 0.1 * rng.standard_normal((nw, k // gs))
    b = 0.1 * rng.standard_normal((nw, k // gs))
    wd = q * np.repeat(s, gs, axis=1) + np.repeat(b, gs, axis=1)
    return x, pack(q), s, b, wd, rng.standard_normal((m, nw))


def main() -> None:
    rng = np.random.default_rng(0)
    worst = 0.0
    # (rows, weight rows, K, group size, block shape): 8, 4, 2 and 1 warps, 64- and
    # 128-row blocks, rows that are not a multiple of the block's, several row chunks
    for m, nw, k, gs, shape in [(40, 256, 256, 64, (64, 8)), (100, 128, 128, 32, (128, 8)),
                                (130, 64, 384, 128, (64, 4)), (64, 32, 256, 64, (64, 2)),
                                (33, 2048, 128, 64, None), (200, 64, 128, 64, (128, 2)),
                                (70, 256, 256, 64, (64, 4, 2)), (40, 128, 384, 64, (64, 2, 2)),
                                (130, 64, 128, 32, (64, 1, 2))]:  # fmt: skip
        x, words, s, b, wd, res = problem(rng, m, nw, k, gs)
        err = np.abs(run(x, words, s, b, gs, shape) - x @ wd.T).max()
        err_r = np.abs(run(x, words, s, b, gs, shape, res) - (res + x @ wd.T)).max()
        gate, up = x @ wd[: nw // 2].T, x @ wd[nw // 2 :].T
        want = gate / (1 + np.exp(-gate)) * up
        err_g = np.abs(run(x, words, s, b, gs, shape, glu=True) - want).max()
        if gs <= 64 and shape:  # the weights-in-shared-memory form
            err_w = np.abs(run(x, words, s, b, gs, shape, ws=True) - x @ wd.T).max()
            err_w = max(
                err_w, np.abs(run(x, words, s, b, gs, shape, glu=True, ws=True) - want).max()
            )
            err_w = max(
                err_w, np.abs(run(x, words, s, b, gs, shape, res, ws=True) - (res + x @ wd.T)).max()
            )
            print(f"  ws form: {err_w:.1e}")
            worst = max(worst, err_w)
        bm, wm, mt = (tuple(shape) + (1,))[:3] if shape else geometry(m, nw // 16)
        print(
            f"rows {m:3d} weight {nw:4d} x {k} group {gs:3d} (block {bm} rows, {wm} warps, "
            f"{mt} m-tiles a warp): "
            f"plain {err:.1e}  residual {err_r:.1e}  glu {err_g:.1e}"
        )
        worst = max(worst, err, err_r, err_g)
    # stream-K: grids that cut tiles in two or in many parts (down to one k-step a
    # block), give a block two cut passes (slots 0 and 1) or whole tiles only; each in
    # three block orders, which must give the same numbers to the bit
    for m, nw, k, gs, shape, grids in [(70, 256, 384, 64, (64, 4, 2), (3, 5, 12)),
                                       (40, 128, 512, 32, (64, 2, 2), (2, 7, 8)),
                                       (130, 64, 256, 64, (64, 1, 2), (2, 4, 5, 9))]:  # fmt: skip
        x, words, s, b, wd, res = problem(rng, m, nw, k, gs)
        gate, up = x @ wd[: nw // 2].T, x @ wd[nw // 2 :].T
        want_g = gate / (1 + np.exp(-gate)) * up
        for grid in grids:
            errs = []
            for kw, want in (({}, x @ wd.T), ({"residual": res}, res + x @ wd.T),
                             ({"glu": True}, want_g)):  # fmt: skip
                outs = [run(x, words, s, b, gs, shape, sk_grid=grid, seed=seed, **kw)
                        for seed in range(3)]  # fmt: skip
                assert all(np.array_equal(outs[0], o) for o in outs[1:]), "order-dependent sums"
                errs.append(np.abs(outs[0] - want).max())
            print(f"stream-K rows {m:3d} weight {nw:4d} x {k} group {gs:3d} block {shape}, "
                  f"{grid} blocks: plain {errs[0]:.1e}  residual {errs[1]:.1e}  glu {errs[2]:.1e}")  # fmt: skip
            worst = max(worst, *errs)
    print("ok" if worst < 1e-9 else "MISMATCH")
    raise SystemExit(0 if worst < 1e-9 else 1)


if __name__ == "__main__":
    main()
