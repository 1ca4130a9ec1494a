"""Several models loaded at once, each on a thread of its own.

Why: a server with several models waited for each load in turn (a GGUF's tensor
conversion and its tokenizer take seconds to minutes). Loads share nothing but MLX
itself, whose streams are per thread: every array a load makes is evaluated on its
own thread before the model leaves it (``materialize``), and the thread releases its
MLX streams when it ends, so no lazy array of one load waits on another thread's
stream and no load sees another's state. The first error is raised after every load
has ended (a ``ModelLoadError`` names its file), never leaving threads behind.
"""

from __future__ import annotations

import threading

from engine.loading.loaded_model import LoadedModel


def load_models(models: list, **kw) -> list[tuple[LoadedModel, int | None]]:
    """``[(LoadedModel, max_context)]`` for ``engine.config.ModelConfig`` entries, in
    their order; ``kw`` goes to every ``load_model`` (e.g. ``cache_dir``)."""
    from engine.loading.loader import load_model

    results: list = [None] * len(models)
    errors: list = [None] * len(models)

    def one(i: int, mc) -> None:
        try:
            results[i] = load_model(mc.source, name=mc.name, weight_format=mc.weight_format, **kw)
        except BaseException as e:  # handed to the caller below
            errors[i] = e
        finally:
            _release_thread_streams()

    if len(models) == 1:  # no thread for one model
        results[0] = load_model(
            models[0].source, name=models[0].name, weight_format=models[0].weight_format, **kw
        )
    else:
        threads = [
            threading.Thread(target=one, args=(i, mc), name=f"load-{mc.name or mc.source}")
            for i, mc in enumerate(models)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in errors:
            if e is not None:
                raise e
    return [(lm, mc.max_context) for lm, mc in zip(results, models)]


def _release_thread_streams() -> None:
    """What engine.worker.release_mlx_thread_state does for its thread: finish the
    thread's work and destroy its MLX streams before the thread ends."""
    import mlx.core as mx

    try:
        mx.synchronize()
    except Exception:
        pass
    clear = getattr(mx, "clear_streams", None)
    if clear is not None:
        clear()
