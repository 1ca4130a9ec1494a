"""Engine settings: limits and batching knobs for one served model."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import platform


@dataclass
class ModelConfig:
    """One model to serve. ``source`` is an alias, a .gguf path or a folder."""

    source: str = "smollm2-135m-instruct"
    name: str | None = None  # the `model` id clients send; default: the alias or file stem
    weight_format: str = "auto"
    max_context: int | None = None  # cap below the model's own context window


@dataclass
class EngineConfig:
    """Batching and memory limits, shared by every model's worker."""

    max_num_seqs: int = 16  # sequences decoded together in one step
    max_queued_requests: int = 256  # waiting beyond this answers 429
    max_kv_tokens: int = 65536  # KV tokens held by running sequences, all together
    # Prompt tokens prefilled per step (chunked prefill). None: by backend, since a
    # 512-token chunk is ~1 s of compute on a 2-core CPU but a few ms on a GPU.
    prefill_chunk_tokens: int | None = None
    prefix_cache_tokens: int = 32768  # KV tokens kept for prefix reuse (LRU), 0 = off
    queue_timeout_s: float = 30.0  # a request waiting longer for a slot gets 429
    default_max_tokens: int = 512
    # Before serving, run one prefill chunk and decode steps at batch sizes 1, 2, 4,
    # ... max_num_seqs on throwaway KV, so the first requests find MLX's JIT kernels
    # and mx.compile traces ready. None: by backend (see warmup_enabled).
    warmup: bool | None = None
    # Build and queue decode step i+1 on step i's sampled tokens (still on the
    # device) before step i's tokens are read back, so the host's graph building
    # and bookkeeping overlap the device's work. None: by backend (see
    # pipeline_decode_enabled).
    pipeline_decode: bool | None = None
    # Ranks one model runs over on this host (tensor parallelism: attention heads and
    # MLP/expert columns split, an all-reduce per block; MLX ring backend on the CPU,
    # NCCL on NVIDIA GPUs). 1 = off. Needs exactly one model.
    tensor_parallel: int = 1
    models: list[ModelConfig] = field(default_factory=lambda: [ModelConfig()])


def default_prefill_chunk_tokens() -> int:
    return 2048 if platform.on_gpu() else 128


def warmup_enabled(config: EngineConfig) -> bool:
    """``config.warmup``, or by backend when it is None: on for a GPU, where a cold
    start compiles kernels for 10-47 s (H200, 2026-12-02; docs/performance.md); off for
    the CPU, where it cost SmolLM2-135M 1.7-3.1 s with MLX's kernel cache already filled
    and saved the first request nothing then (0.38 s either way; 2 cores of an AMD EPYC). With an
    empty kernel cache (a machine's first run) it took 13 s and the first request
    without it 7.2 s: ``--warmup`` is worth it there."""
    if config.warmup is not None:
        return config.warmup
    return platform.on_gpu()


def pipeline_decode_enabled(config: EngineConfig) -> bool:
    """``config.pipeline_decode``, or by backend when it is None: on for a GPU, where
    the host builds the next step while the GPU runs this one (4-bit 1b: +41% at
    B=1, fused bf16 +57%; H200, 2026-12-02); off for the CPU, where it measured
    1.02x / 0.95x / 1.00x at 1 / 4 / 16 rows (SmolLM2 through ``EngineClient``, 2
    cores, 2026-12-07: the host's work between steps is small against a step there)
    and each token would reach its client one step later."""
    if config.pipeline_decode is not None:
        return config.pipeline_decode
    return platform.on_gpu()


def warmup_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes the warm-up runs: powers of two below ``max_num_seqs``, and it."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max(1, max_num_seqs)]


# Prompt chunks of these row counts run below the GPU prefill's dequantize route
# (engine/backends/cuda/prefill.py): on gpu_mma's kernel by default, whose forms compile per band
# of rows (~1-6 s each under NVRTC), or with MARKBASE_GPU_PREFILL_SMALL=mlx on MLX's
# quantized_matmul, which JIT-compiles one qmm_sm80 kernel per tile size (m16 up to 16
# rows, m32 17-32, m64 33+; 23-28 s each on an H100: without these rows in the warm-up
# a 97-token prompt's first request waited 27.4 s). One chunk in each power-of-two band
# up to 256 rows covers either route (H100, 2026-12-05, from an empty PTX cache: no new
# prompt length of 2-1,500 tokens waited after the warm-up; docs/performance.md).
WARMUP_PREFILL_ROWS = (12, 24, 48, 96, 192)


def warmup_prefill_rows(chunk_tokens: int, context_length: int) -> list[int]:
    """Prompt-chunk row counts the warm-up prefills besides its main chunk: those of
    WARMUP_PREFILL_ROWS that a chunk can have (below ``chunk_tokens``) and the context
    holds."""
    return [r for r in WARMUP_PREFILL_ROWS if r < chunk_tokens and r < context_length - 1]
