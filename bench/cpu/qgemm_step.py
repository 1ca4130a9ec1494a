"""Decode step of the default model on the CPU: quantized products (engine/backends/cpu/qgemm.py)
vs float32 OpenBLAS, interleaved in one process (the shim switches per call).

    .venv/bin/python bench/cpu/qgemm_step.py 1 4 16

Prints ms/step and tokens/s per batch size; ratios matter, absolute times are noisy.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.backends.cpu.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine.backends.cpu import qgemm as cpu_qgemm  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402


def main(batches: list[int]) -> None:
    lm = load_model("smollm2-135m-instruct", weight_format="float32")
    runner = ModelRunner(lm.model, lm.cpu_shadows)
    lib = cpu_qgemm._lib()
    if runner.qgemm is None or lib is None:
        sys.exit(f"quantized products unavailable: {cpu_qgemm.available()}")
    prompt = lm.tokenizer.encode("The capital of France is")
    print("| batch | quantized ms/step | tok/s | float32 ms/step | tok/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for b in batches:
        res: dict[str, list[float]] = {"q": [], "f": []}
        for mode in ("q", "f", "q", "f"):
            lib.markbase_qw_config(1 if mode == "q" else 0, -1, -1, -1)
            batch = runner.new_batch_kv()
            for _ in range(b):
                kv = runner.new_sequence_kv()
                logits = runner.prefill(kv, prompt, True)
                mx.eval(logits)
                for layer, seq in zip(batch, kv):
                    layer.add(seq.keys[:, :, : seq.offset], seq.values[:, :, : seq.offset])
            toks = [int(mx.argmax(logits))] * b
            times = []
            for _ in range(40):
                t = time.perf_counter()
                toks = mx.argmax(runner.decode(batch, toks), axis=-1).tolist()
                times.append(time.perf_counter() - t)
            res[mode].append(float(np.median(times[5:])) * 1e3)
        q, f = min(res["q"]), min(res["f"])
        print(f"| {b} | {q:.1f} | {b / q * 1e3:.0f} | {f:.1f} | {b / f * 1e3:.0f} | {f / q:.2f}x |")
    lib.markbase_qw_config(1, -1, -1, -1)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 4, 16])
