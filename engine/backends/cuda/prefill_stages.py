"""Start a prompt chunk on the GPU while the host is still building its later layers.

Why: MLX builds a forward lazily, so for a prompt chunk the host first builds every
layer's ops in Python, and only ``mx.eval`` at the end hands work to the GPU; until
then the GPU idles. A CUPTI profile of one 2048-token chunk (H100,
``bench/gpu/suite.sh prefill-profile``) showed one idle gap a chunk of ~3.3 ms at 1b
(11.1 ms wall, 7.9 ms busy) and ~8 ms at 8b 4-bit (62.8 ms wall, 52 ms busy).
PyTorch eager launches each kernel as Python reaches it, so it never pays this.

Here some layers' caches are marked (``SequenceKV.stage``/``PromptBatchKV.stage``):
when such a layer stores its new keys and values it queues them with
``mx.async_eval``, which sends everything they depend on (all earlier layers) to the
GPU. The host keeps building while the GPU runs; the final evaluation queues the
rest. The first stage comes early (layer 1) so the GPU starts after about one
layer's build, then one every ``every`` layers: the GPU spends longer on a layer of
a long chunk than the host does building it, so it does not run dry in between.

Only on a GPU (on the CPU the host's building shares the cores with the compute)
and only for chunks of ``MIN_ROWS`` rows or more (a short chunk's build is short).
``MARKBASE_GPU_PREFILL_STAGES``: layers between stages (default 4), 0 turns it off.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from engine import envs

ENV = "MARKBASE_GPU_PREFILL_STAGES"
MIN_ROWS = 128


def every_from_env() -> int:
    return envs.value(ENV)


def stage_layers(num_layers: int, every: int) -> list[int]:
    """The layers whose cache queues the forward so far: 1, 1 + every, ... before the last."""
    if every <= 0:
        return []
    return list(range(1, num_layers - 1, every))


@contextmanager
def staged(caches: Sequence, rows: int, every: int) -> Iterator[None]:
    """Mark ``caches`` (one a layer) for one forward of ``rows`` prompt rows."""
    marked = [caches[i] for i in stage_layers(len(caches), every)] if rows >= MIN_ROWS else []
    for cache in marked:
        cache.stage = True
    try:
        yield
    finally:
        for cache in marked:
            cache.stage = False
