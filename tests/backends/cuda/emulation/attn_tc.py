"""engine/backends/cuda/attention/decode_tc.py's kernel, lane by lane in numpy (no GPU).

The kernel's index logic (which warp takes which (row, KV head) and which tiles, the
tiles starting at each row's first valid slot, keys past the end, the new slot taken
from the warp's copy, the query heads as the A fragment's rows, the ldmatrix
addresses, the score accumulators reused as the P.V A fragment, the online softmax's
quad reductions and, in the split form, the warps' merge) is transcribed statement by
statement, each MMA and ldmatrix done as the PTX ISA's fragment layouts say
(bench/gpu/prefill_attn_emulation.py's helpers, which the prompt kernel's GPU tests
back). Checked against RoPE + attention over ``[start, T]`` in float64 (no bf16
rounding: this checks the indices, the GPU tests check the numbers).

    .venv/bin/python bench/gpu/attn_tc_emulation.py
"""

from __future__ import annotations

import numpy as np

from tests.backends.cuda.emulation.prefill_attn import a_regs, ldm4, mma


def rope(x, pos, inv_freq, trad):
    """MLX's RoPE of one head's vector ``x`` [HD] at position ``pos``."""
    hd = x.shape[0]
    out = np.empty(hd)
    for d in range(hd):
        th = pos * inv_freq[d // 2 if trad else d % (hd // 2)]
        c, s = np.cos(th), np.sin(th)
        if trad:
            p = x[d ^ 1]
            out[d] = p * s + x[d] * c if d & 1 else x[d] * c - p * s
        else:
            p = x[d + hd // 2] if d < hd // 2 else x[d - hd // 2]
            out[d] = x[d] * c - p * s if d < hd // 2 else p * s + x[d] * c
    return out


def reference(qkv, keys, values, start, pos, inv_freq, trad, scale, group):
    """RoPE on q and the new k, the new k/v at slot T, attention over [start, T]."""
    b_n, n_kv, t_cached, hd = keys.shape
    out = np.zeros((b_n, n_kv * group, hd))
    for b in range(b_n):
        for h in range(n_kv):
            base = n_kv * group * hd
            kn = rope(qkv[b, base + h * hd : base + (h + 1) * hd], pos[b], inv_freq, trad)
            vn = qkv[b, base + n_kv * hd + h * hd : base + n_kv * hd + (h + 1) * hd]
            k = np.concatenate([keys[b, h, start[b] :], kn[None]])
            v = np.concatenate([values[b, h, start[b] :], vn[None]])
            for g in range(group):
                hq = h * group + g
                q = rope(qkv[b, hq * hd : (hq + 1) * hd], pos[b], inv_freq, trad)
                s = k @ q * scale
                p = np.exp(s - s.max())
                out[b, hq] = p @ v / p.sum()
    return out


def kernel(qkv, keys, values, start, pos, inv_freq, trad, scale, group, warps, bk, split,
           parts=1):  # fmt: skip
    """The CUDA source for every block, warp and lane. ``keys``/``values``: the cache
    [B, Hkv, T, D] whose slot T - 1 is the new one (its contents ignored). ``parts``
    (split form, MB_TC_MULTI): blocks a (row, KV head), each a contiguous share of its
    tiles, their partials merged as the unit's last block does."""
    b_n, n_kv, t_len_all, hd = keys.shape
    g_n = group
    ks_n, dt, rs = hd // 16, hd // 8, hd + 8
    units = b_n * n_kv
    blocks = units * parts if split else -(-units // warps)
    out = np.full((b_n, n_kv * g_n, hd), np.nan)
    sl2 = scale * np.log2(np.e)
    partials = {}  # unit -> [(part, M [G], L [G], A [G, HD])]
    for bx in range(blocks):
        states = []
        for warp in range(warps):
            unit = bx // parts if split else bx * warps + warp
            part = bx % parts if split else 0
            if unit >= units:
                continue
            b, hkv = divmod(unit, n_kv)
            row0, t_len = start[b], t_len_all
            t_new = t_len - 1
            nq = n_kv * g_n * hd
            xb = qkv[b]
            qsm = np.stack([rope(xb[(hkv * g_n + i) * hd :][:hd], pos[b], inv_freq, trad)
                            for i in range(g_n)])  # fmt: skip
            kn = rope(xb[nq + hkv * hd :][:hd], pos[b], inv_freq, trad)
            vn = xb[nq + n_kv * hd + hkv * hd :][:hd]
            ntiles = (t_len - row0 + bk - 1) // bk
            tpp = -(-ntiles // parts)
            kt_hi = min(ntiles, (part + 1) * tpp)
            # qf[kk][lane]: rows g < G the query heads, rows g + 8 and g >= G zero
            qf = [
                a_regs(lambda r, c, kk=kk, qsm=qsm: qsm[r, kk * 16 + c] if r < g_n else 0.0)
                for kk in range(ks_n)
            ]
            m0 = np.full(32, -np.inf)
            l0 = np.zeros(32)
            o = np.zeros((dt, 32, 4))
            kstep = warps if split else 1
            kt = part * tpp + warp if split else 0
            while kt < kt_hi:
                k0 = row0 + kt * bk
                ks = np.zeros((bk, rs))
                vs = np.zeros((bk, rs))
                for r in range(bk):  # load(): cp.async, zeros past the end
                    key = k0 + r
                    if key != t_new and key < t_len:
                        ks[r, :hd], vs[r, :hd] = keys[b, hkv, key], values[b, hkv, key]
                if t_new - k0 < bk:  # the patch of the new slot
                    ks[t_new - k0, :hd], vs[t_new - k0, :hd] = kn, vn
                s = np.zeros((bk // 8, 32, 4))
                for j in range(bk // 8):
                    for kk in range(0, ks_n, 2):
                        r = ldm4(ks, lambda ln, j=j, kk=kk: (j * 8 + (ln & 7),
                                                             (ln >> 3) * 8 + kk * 16), False)  # fmt: skip
                        # mb_mma(s[j], qf[kk][0], 0, qf[kk][1], 0, ...): a1, a3 (rows g+8) zero
                        for kq, (i0, i1) in ((kk, (0, 1)), (kk + 1, (2, 3))):
                            a = [[qf[kq][ln][0], (0.0, 0.0), qf[kq][ln][2], (0.0, 0.0)]
                                 for ln in range(32)]  # fmt: skip
                            mma(s[j], a, [(x[i0], x[i1]) for x in r])
                mx0 = np.full(32, -np.inf)
                for lane in range(32):
                    g, tg = divmod(lane, 4)
                    for j in range(bk // 8):
                        for e in range(2):
                            key = k0 + j * 8 + tg * 2 + e
                            v = s[j, lane, e] * sl2 if key < t_len else -np.inf
                            s[j, lane, e] = v
                            mx0[lane] = max(mx0[lane], v)
                mx0 = np.repeat(mx0.reshape(8, 4).max(axis=1), 4)  # shfl_xor 1, 2
                n0 = np.maximum(m0, mx0)
                a0 = np.exp2(m0 - n0)
                m0 = n0
                l0 *= a0
                o[:, :, 0:2] *= a0[None, :, None]
                p = np.exp2(s[:, :, 0:2] - n0[None, :, None])  # [NT][lane][2]
                l0 += p.sum(axis=(0, 2))
                for kk in range(bk // 16):
                    aregs = [[p[2 * kk, ln], (0.0, 0.0), p[2 * kk + 1, ln], (0.0, 0.0)]
                             for ln in range(32)]  # fmt: skip
                    for d in range(0, dt, 2):
                        r = ldm4(vs, lambda ln, kk=kk, d=d: (kk * 16 + (ln & 7) + ((ln >> 3) & 1) * 8,
                                                             (ln >> 4) * 8 + d * 8), True)  # fmt: skip
                        mma(o[d], aregs, [(x[0], x[1]) for x in r])
                        mma(o[d + 1], aregs, [(x[2], x[3]) for x in r])
                kt += kstep
            l0 = np.repeat(l0.reshape(8, 4).sum(axis=1), 4)
            states.append((b, hkv, m0, l0, o, unit, part))
            if not split:
                for lane in range(32):
                    g, tg = divmod(lane, 4)
                    if g < g_n:
                        for d in range(dt):
                            out[b, hkv * g_n + g, d * 8 + tg * 2 : d * 8 + tg * 2 + 2] = (
                                o[d, lane, 0:2] / l0[lane]
                            )
        if split:
            b, hkv = states[0][0], states[0][1]
            sm_m = np.array([[st[2][4 * g] for g in range(8)] for st in states])
            sm_l = np.array([[st[3][4 * g] for g in range(8)] for st in states])
            sm_o = np.zeros((warps, g_n, hd))
            for w, st in enumerate(states):
                for lane in range(32):
                    g, tg = divmod(lane, 4)
                    if g < g_n:
                        for d in range(dt):
                            sm_o[w, g, d * 8 + tg * 2 : d * 8 + tg * 2 + 2] = st[4][d, lane, 0:2]
            big_m, big_l, big_a = np.full(g_n, -np.inf), np.zeros(g_n), np.zeros((g_n, hd))
            for gg in range(g_n):
                big = sm_m[:, gg].max()
                if big == -np.inf:  # a part without tiles: its partial is -inf, 0, 0
                    continue
                ok = sm_m[:, gg] != -np.inf
                e = np.where(ok, np.exp2(np.where(ok, sm_m[:, gg], 0) - big), 0.0)
                big_m[gg], big_l[gg] = big, (sm_l[:, gg] * e).sum()
                big_a[gg] = (sm_o[:, gg] * e[:, None]).sum(0)
            if parts == 1:
                out[b, hkv * g_n : (hkv + 1) * g_n] = big_a / big_l[:, None]
            else:
                partials.setdefault(states[0][5], []).append((big_m, big_l, big_a))
    for unit, got in partials.items():  # the unit's last block: every part merged
        b, hkv = divmod(unit, n_kv)
        assert len(got) == parts
        pm = np.array([x[0] for x in got])  # [parts, G]
        m = pm.max(axis=0)
        e = np.where(pm == -np.inf, 0.0, np.exp2(np.where(pm == -np.inf, 0, pm) - m))
        big_l = (np.array([x[1] for x in got]) * e).sum(0)
        big_a = (np.array([x[2] for x in got]) * e[:, :, None]).sum(0)
        out[b, hkv * g_n : (hkv + 1) * g_n] = big_a / big_l[:, None]
    return out


def check(b_n, n_kv, group, t_cached, hd, starts, warps, bk, split, trad, parts=1,
          seed=0) -> float:  # fmt: skip
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((b_n, (n_kv * group + 2 * n_kv) * hd))
    keys = rng.standard_normal((b_n, n_kv, t_cached + 1, hd))
    values = rng.standard_normal((b_n, n_kv, t_cached + 1, hd))
    start = np.array(starts)
    pos = np.array([t_cached - s + 5 for s in starts])
    inv_freq = 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    scale = hd**-0.5
    want = reference(qkv, keys[:, :, :t_cached], values[:, :, :t_cached], start, pos,
                     inv_freq, trad, scale, group)  # fmt: skip
    got = kernel(qkv, keys, values, start, pos, inv_freq, trad, scale, group, warps, bk, split,
                 parts)  # fmt: skip
    return float(np.abs(got - want).max())


CASES = [
    # (B, Hkv, G, T cached, D, starts, warps, keys a tile, split, traditional)
    (3, 2, 4, 40, 64, [0, 5, 40], 4, 16, False, False),
    (2, 2, 2, 70, 128, [3, 70], 1, 32, False, True),
    (1, 2, 4, 90, 64, [0], 4, 16, True, False),
    (2, 1, 8, 50, 64, [30, 1], 8, 16, True, True),  # fewer tiles than warps
    (1, 1, 1, 33, 128, [0], 2, 32, True, False),
    # several blocks a (row, KV head): 6 tiles over 5 parts (two parts without tiles),
    # ragged starts, a row with only the new slot, more tiles than a part's warps
    (2, 2, 4, 90, 64, [0, 90], 1, 16, True, False, 5),
    (1, 2, 4, 300, 64, [7], 2, 16, True, True, 3),
    (3, 1, 8, 70, 128, [0, 30, 65], 4, 16, True, False, 2),
]


def main() -> None:
    worst = 0.0
    for case in CASES:
        err = check(*case)
        worst = max(worst, err)
        print(f"{case}: max |error| {err:.2e}")
    assert worst < 1e-9, worst
    print("ok")


if __name__ == "__main__":
    main()
