"""Quantize a model into an mlx-lm folder that ``markbase serve`` (and mlx-lm) load.

    markbase quantize smollm2-135m-instruct ./smollm2-q4 --bits 4 --group-size 64
    markbase serve --model ./smollm2-q4

SRC is anything the server loads (a built-in alias, a .gguf file, a folder). Its
weights are loaded as float32 (quantized GGUF blocks are dequantized), cast to
``--dtype``, and every linear and embedding layer whose input size is a multiple of
the group size is quantized with MLX's affine quantization (as ``mlx_lm.convert
-q`` does). DST gets config.json (with its ``quantization`` entry),
model.safetensors and the tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("markbase.progress")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="built-in alias, .gguf file or model folder")
    p.add_argument("dst", metavar="DST", help="output folder (must not exist, or be empty)")
    p.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5, 6, 8))
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument(
        "--dtype",
        default="float16",
        choices=("float16", "bfloat16", "float32"),
        help="dtype of the weights left unquantized and of the scales (default: float16)",
    )


def quantize_folder(src: str, dst: Path, bits: int, group_size: int, dtype: str) -> dict:
    """Load ``src``, quantize it, write ``dst``; returns the config's quantization."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.loading import export_mlx_folder, load_model
    from engine.loading.safetensors_folder import model_quantization

    t0 = time.monotonic()
    loaded = load_model(src, weight_format="float32")
    log.info("loaded %s (%s) in %.1f s", src, loaded.weight_format, time.monotonic() - t0)
    t1 = time.monotonic()
    loaded.model.set_dtype(getattr(mx, dtype))

    def predicate(_path: str, module: nn.Module) -> bool:
        w = getattr(module, "weight", None)
        return hasattr(module, "to_quantized") and w is not None and w.shape[-1] % group_size == 0

    nn.quantize(loaded.model, group_size=group_size, bits=bits, class_predicate=predicate)
    mx.eval(loaded.model.parameters())
    quant = model_quantization(loaded.model)
    if quant is None:
        raise SystemExit(
            f"markbase quantize: no layer of {src} has an input size divisible by {group_size}"
        )
    log.info(
        "quantized to %d bits, group size %d in %.1f s", bits, group_size, time.monotonic() - t1
    )
    t2 = time.monotonic()
    export_mlx_folder(loaded, dst)
    log.info("wrote %s in %.1f s", dst, time.monotonic() - t2)
    return quant


def run(args: argparse.Namespace) -> int:
    dst = Path(args.dst).expanduser()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        print(f"markbase quantize: {dst} exists and is not an empty folder", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from cli.main import prepare_mlx

    prepare_mlx()
    from engine.loading import ModelLoadError

    try:
        quant = quantize_folder(args.src, dst, args.bits, args.group_size, args.dtype)
    except ModelLoadError as e:
        print(f"markbase quantize: cannot load {args.src}: {e}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    print(f"{dst}: {quant['bits']}-bit, group size {quant['group_size']}, {size / 1e6:.1f} MB")
    print(f"serve it with: markbase serve --model {dst}")
    return 0
