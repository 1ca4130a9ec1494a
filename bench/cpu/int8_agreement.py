"""How far int8 inputs (``MARKBASE_QGEMM_INT8=1``) move a model's next-token
distribution from the float products': teacher-forced decode through the engine's
own runner, both ways over the same tokens. A bench script, not a test.

    .venv/bin/python bench/cpu/int8_agreement.py                     # SmolLM2, README text
    .venv/bin/python bench/cpu/int8_agreement.py --model gemma3-270m --tokens 300

The prompt (the first ``--prompt`` tokens of ``--text``) is prefilled with float
products; then each following token of the text is fed as a decode step (the path the
int8 switch changes) and the step's logits are kept. Printed: top-1 agreement of the
two runs, the KL divergence of int8's distribution from the float one's (mean, p99,
max, nats) and the largest logit difference. The products are switched in the shim
between runs, in one process, so the weights and the graph are the same.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.backends.cpu.blas import ensure_fast_blas  # noqa: E402

ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from engine.backends.cpu import qgemm as cpu_qgemm  # noqa: E402
from engine.client import EngineClient  # noqa: E402
from engine.config import EngineConfig, ModelConfig  # noqa: E402


def _log_softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(1, keepdims=True)
    return a - np.log(np.exp(a).sum(1, keepdims=True))


def _logits(runner, prompt: list[int], cont: list[int], int8: bool) -> tuple[np.ndarray, int]:
    lib = cpu_qgemm._lib()
    lib.markbase_qw_set_int8(0)
    kv = runner.new_sequence_kv()
    runner.prefill(kv, prompt, False)
    batch = runner.new_batch_kv()
    runner.join_batch(batch, kv, kv.rows())
    lib.markbase_qw_set_int8(int(int8))
    before, out = cpu_qgemm.hits(), []
    try:
        for t in cont:
            lg = runner.decode(batch, [t])
            mx.eval(lg)
            out.append(np.asarray(lg[0].astype(mx.float32)))
    finally:
        lib.markbase_qw_set_int8(0)
    return np.stack(out), cpu_qgemm.hits() - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--text", default=str(ROOT / "README.md"))
    ap.add_argument("--prompt", type=int, default=20, help="tokens prefilled first")
    ap.add_argument("--tokens", type=int, default=400, help="decode steps compared")
    args = ap.parse_args()
    lib = cpu_qgemm._lib()
    if lib is None or not lib.markbase_qw_has_int8():
        sys.exit(f"no int8 products here: {cpu_qgemm.available() or 'the CPU lacks AVX2/VNNI'}")
    cfg = EngineConfig(models=[ModelConfig(source=args.model, weight_format="float32")])
    client = EngineClient.start(cfg)
    try:
        worker = next(iter(client._workers.values()))
        ids = worker.tokenizer.encode(pathlib.Path(args.text).read_text())
        prompt, cont = ids[: args.prompt], ids[args.prompt : args.prompt + args.tokens]
        f, hits_f = _logits(worker.runner, prompt, cont, False)
        q, hits_q = _logits(worker.runner, prompt, cont, True)
    finally:
        client.shutdown()
    if not hits_f or hits_f != hits_q:
        sys.exit(f"the decode steps did not take the quantized products ({hits_f}, {hits_q})")
    pf, pq = _log_softmax(f), _log_softmax(q)
    kl = (np.exp(pf) * (pf - pq)).sum(1)
    agree = float((f.argmax(1) == q.argmax(1)).mean())
    print(f"# {args.model}, {len(cont)} decode steps over {pathlib.Path(args.text).name}")
    print("| top-1 agreement | KL mean | KL p99 | KL max | largest logit difference |")
    print("|---:|---:|---:|---:|---:|")
    print(
        f"| {agree:.2%} | {kl.mean():.4f} | {np.quantile(kl, 0.99):.4f} | {kl.max():.4f} "
        f"| {np.abs(f - q).max():.3f} |"
    )


if __name__ == "__main__":
    main()
