"""GGML block formats -> MLX affine group quantization, in vectorised numpy.

MLX affine quantization stores, per row, groups of ``group_size`` values as ``w = scale * q +
bias`` with ``q`` an unsigned ``bits``-bit integer, packed little-endian as a bit stream into
uint32 words. Several GGML block formats are exactly that with group 32, so they transcode
without loss:

    Q4_0  w = d*(q-8)          -> 4 bit, scale d,      bias -8d
    Q4_1  w = d*q + m          -> 4 bit, scale d,      bias m
    Q5_0  w = d*(q-16)         -> 5 bit, scale d,      bias -16d
    Q5_1  w = d*q + m          -> 5 bit, scale d,      bias m
    Q8_0  w = d*q, q int8      -> 8 bit, q+128,        bias -128d
    Q4_K  w = d*sc*q - dmin*m  -> 4 bit, scale d*sc,   bias -dmin*m   (8 sub-blocks of 32)
    Q5_K  same with 5 bits     -> 5 bit

The rest (Q6_K has 16-wide sub-blocks, which MLX cannot group; Q2_K, Q3_K, IQ*, ...) are
dequantized to float32 here (fast paths for Q6_K, ``gguf.quants`` for the exotic ones) and
requantized by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.constants import GGMLQuantizationType as T

GROUP = 32


@dataclass
class Packed:
    """One MLX-quantized matrix: ``weight`` uint32 (rows, cols*bits/32), scales/biases float32."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int = GROUP


# GGML type -> bits of its exact MLX form. Types not listed are dequantized.
EXACT_BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q4_K: 4, T.Q5_K: 5}
FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16, T.F64: np.float64}


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints (last axis, a multiple of 32) into MLX's uint32 bit stream."""
    rows, cols = q.shape
    q = q.astype(np.uint8, copy=False)
    if bits == 8:
        packed = np.ascontiguousarray(q)
    elif bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
    else:
        # 8 values of `bits` bits fill exactly `bits` bytes. Output byte k of a group takes
        # the values whose bit range overlaps bits 8k..8k+7; uint8 shifts drop the overflow.
        v = q.reshape(rows, cols // 8, 8)
        packed = np.empty((rows, cols // 8, bits), dtype=np.uint8)
        for k in range(bits):
            byte = np.zeros((rows, cols // 8), dtype=np.uint8)
            for i in range(8):
                shift = i * bits - 8 * k
                if -bits < shift < 8:
                    vi = v[:, :, i]
                    byte |= (vi << shift) if shift >= 0 else (vi >> -shift)
            packed[:, :, k] = byte
        packed = packed.reshape(rows, -1)
    return np.ascontiguousarray(packed).view(np.uint32)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32. Every GGML block size
    and field offset is even, so the blocks are read as float16 pairs in place (a copy
    of the 2-byte strided slice first cost ~1.7 s of Gemma 3 270M's 8 s load)."""
    return blocks.view(np.float16)[..., start // 2].astype(np.float32)


def _blocks(raw: np.ndarray, type_size: int) -> np.ndarray:
    rows = raw.shape[0]
    return raw.reshape(rows, -1, type_size)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: element j is qs[j] & 15, element j+16 is qs[j] >> 4."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes (uint32 LE) -> 32 single bits, element j = bit j."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")
    return bits  # (..., 32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins -> (..., 8) each."""
    d = scales[..., 0:4]
    m = scales[..., 4:8]
    md = scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def transcode(raw: np.ndarray, gtype: T) -> Packed:
    """Exact MLX form of a GGML-quantized matrix; ``raw`` is (rows, bytes_per_row) uint8."""
    q, scale, bias, bits = decode(raw, gtype)
    return Packed(weight=pack_bits(q, bits), scales=scale, biases=bias, bits=bits)


def decode(raw: np.ndarray, gtype: T) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(q uint8 (rows, cols), scale, bias float32 (rows, cols/32), bits) with w = scale*q + bias."""
    rows = raw.shape[0]
    if gtype in (T.Q4_0, T.Q4_1):
        has_min = gtype == T.Q4_1
        b = _blocks(raw, 20 if has_min else 18)
        d = _f16(b, 0)
        bias = _f16(b, 2) if has_min else -8.0 * d
        qs = b[..., 4:] if has_min else b[..., 2:]
        q = _nibbles_32(qs)
        bits = 4
    elif gtype in (T.Q5_0, T.Q5_1):
        has_min = gtype == T.Q5_1
        b = _blocks(raw, 24 if has_min else 22)
        d = _f16(b, 0)
        bias = _f16(b, 2) if has_min else -16.0 * d
        off = 4 if has_min else 2
        qh = _high_bits(b[..., off : off + 4])
        q = _nibbles_32(b[..., off + 4 :]) | (qh << 4)
        bits = 5
    elif gtype == T.Q8_0:
        b = _blocks(raw, 34)
        d = _f16(b, 0)
        bias = -128.0 * d
        q = b[..., 2:] ^ np.uint8(0x80)  # int8 two's complement + 128
        bits = 8
    elif gtype in (T.Q4_K, T.Q5_K):
        five = gtype == T.Q5_K
        b = _blocks(raw, 176 if five else 144)
        nb = b.shape[1]
        d = _f16(b, 0)[..., None]
        dmin = _f16(b, 2)[..., None]
        sc, mn = _k_scale_min(b[..., 4:16])
        scale = d * sc.astype(np.float32)  # (rows, nb, 8)
        bias = -(dmin * mn.astype(np.float32))
        qs = b[..., 48:] if five else b[..., 16:]
        qs = qs.reshape(rows, nb, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, nb, 8, 32)
        if five:
            qh = b[..., 16:48]  # (rows, nb, 32): bit s of qh[l] is the high bit of sub-block s
            hb = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            q = q | (hb << 4)
        d, bias, bits = scale, bias, (5 if five else 4)
    else:
        raise ValueError(f"no exact MLX form for {gtype.name}")
    return (
        q.reshape(rows, -1),
        np.ascontiguousarray(d.reshape(rows, -1), dtype=np.float32),
        np.ascontiguousarray(bias.reshape(rows, -1), dtype=np.float32),
        bits,
    )


Q6_K_GROUP = 16  # Q6_K: a scale per 16 weights (an int8 sub-block scale times the block's d)


def decode_q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K as (q uint8 (rows, cols) in 0..63, scale float32 (rows, cols/16)) with
    w = scale * (q - 32); ``scale`` is exact in float32 (float16 d times an int8), so
    ``fma(q, scale, -32 scale)`` rounds to the same float32 as ``(q - 32) * scale``."""
    rows = raw.shape[0]
    b = _blocks(raw, 210)
    nb = b.shape[1]
    ql = b[..., 0:128].reshape(rows, nb, 2, 64)
    qh = b[..., 128:192].reshape(rows, nb, 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # (rows, nb, 16)
    d = _f16(b, 208)[..., None] * sc
    lo = np.stack([ql & 0x0F, ql >> 4], axis=3).reshape(rows, nb, 2, 4, 32)
    hi = (qh[:, :, :, None, :] >> np.array([0, 2, 4, 6], np.uint8)[None, None, None, :, None]) & 3
    q = (lo | (hi << 4)).astype(np.uint8)
    return q.reshape(rows, -1), np.ascontiguousarray(d.reshape(rows, -1), dtype=np.float32)


def expand_q6_k(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 (rows, cols) of ``decode_q6_k``'s output: ``(q - 32) * scale`` per 16."""
    rows = q.shape[0]
    w = (q.astype(np.float32) - 32.0).reshape(rows, -1, Q6_K_GROUP) * scale[..., None]
    return w.reshape(rows, -1)


def dequantize(raw: np.ndarray, gtype: T, cols: int) -> np.ndarray:
    """float32 (rows, cols) of any GGML tensor ``raw`` (rows, bytes_per_row)."""
    rows = raw.shape[0]
    if gtype in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[gtype]).reshape(rows, cols).astype(np.float32)
    if gtype == T.BF16:
        u = raw.view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(rows, cols)
    if gtype in EXACT_BITS:
        q, scale, bias, _ = decode(raw, gtype)
        return expand(q, scale, bias)
    if gtype == T.Q6_K:
        return expand_q6_k(*decode_q6_k(raw))
    from gguf.quants import dequantize as gguf_dequantize

    return gguf_dequantize(raw, gtype).reshape(rows, cols).astype(np.float32)


def expand(q: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """float32 (rows, cols) of ``decode``'s output: ``scale * q + bias`` per group of 32."""
    rows, groups = scale.shape
    w = q.reshape(rows, groups, GROUP).astype(np.float32)
    w *= scale[..., None]
    w += bias[..., None]
    return w.reshape(rows, -1)


def unpack(p: Packed) -> np.ndarray:
    """float32 of a Packed matrix (reference implementation, used for tests and fallbacks)."""
    rows = p.weight.shape[0]
    bytes_ = np.ascontiguousarray(p.weight).view(np.uint8)
    bitstream = np.unpackbits(bytes_, axis=-1, bitorder="little").reshape(rows, -1, p.bits)
    q = (bitstream.astype(np.uint32) << np.arange(p.bits, dtype=np.uint32)).sum(-1)
    q = q.reshape(rows, -1, p.group_size).astype(np.float32)
    return (q * p.scales[..., None] + p.biases[..., None]).reshape(rows, -1)
