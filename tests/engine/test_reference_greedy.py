"""Greedy decoding of our models against an independent reference on the same GGUF files.

The reference is Hugging Face transformers' own GGUF path (its GGUF reader, dequantization,
name mapping, Q/K un-permutation, Gemma norm handling and model code) on PyTorch CPU in
float32. It runs in a subprocess (torch and its memory stay out of this process) and its
tokens are cached under the markbase cache dir, keyed by the GGUF file and the
transformers/torch versions, because Gemma takes a minute or more to load there. Delete
``<cache>/reference/`` (or set MARKBASE_REFERENCE_RECOMPUTE=1) to recompute.

llama.cpp itself (llama-cpp-python 0.3.36) agreed with the reference on the recorded
prompts: Gemma's first 11 tokens identically (then a near-tie), SmolLM2's first 5.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engine.loading.convert_cache import cache_root, digest, file_stat_key
from tests.helpers.models import (
    FRANCE,
    GEMMA,
    SMOLLM2,
    builtin_path,
    greedy,
    real_model,
    sequence_logits,
)

# `make test` installs PyTorch here, beside the venv, not in it (Makefile: TORCH_SITE)
TORCH_SITE = Path(sys.prefix) / "torch-site"


def _torch_version() -> str | None:
    """PyTorch's version in TORCH_SITE or this environment, without importing it."""
    for dist in importlib.metadata.distributions(path=[str(TORCH_SITE), *sys.path]):
        if dist.metadata["Name"] == "torch":
            return dist.version
    return None


if _torch_version() is None:
    pytest.skip("no PyTorch for the reference (make test installs it)", allow_module_level=True)

N_TOKENS = 24

_HF_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.append(sys.argv[4])  # PyTorch's folder, after the venv's own packages
    import torch
    import transformers.modeling_utils as mu
    # transformers refuses GGUF without accelerate, which it only needs for device maps.
    mu.is_accelerate_available = lambda: True
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    path, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    print("RESULT " + json.dumps(out))
    """
)


def hf_reference(alias: str, prompts: list[list[int]], n: int = N_TOKENS) -> list[list[int]]:
    import transformers

    path = builtin_path(alias)
    key = digest(file_stat_key(path), transformers.__version__, _torch_version(), prompts, n)
    cached = cache_root() / "reference" / f"{alias}-{key}.json"
    if cached.exists() and not os.environ.get("MARKBASE_REFERENCE_RECOMPUTE"):
        return json.loads(cached.read_text())
    proc = subprocess.run(
        [sys.executable, "-c", _HF_SCRIPT, str(path), json.dumps(prompts), str(n), str(TORCH_SITE)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(result))
    return result


def teacher_forced_report(loaded, prompt: list[int], ref: list[int]) -> tuple[int, float]:
    """Feed prompt + reference tokens through our model once. Returns (greedy tokens that
    match before the first disagreement, the largest logit gap by which our model prefers
    another token over the reference's at any position)."""
    logits = sequence_logits(loaded, prompt + ref)[len(prompt) - 1 : -1]
    ours = logits.argmax(-1)
    prefix = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    gaps = logits.max(-1) - logits[np.arange(len(ref)), ref]
    return prefix, float(gaps.max())


def _prompts(alias: str) -> list[list[int]]:
    tok = real_model(alias).tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    return [tok.encode(FRANCE), chat]


def test_smollm2_greedy_matches_hf():
    lm = real_model(SMOLLM2)
    prompts = _prompts(SMOLLM2)
    refs = hf_reference(SMOLLM2, prompts)
    for prompt, ref in zip(prompts, refs):
        ours = greedy(lm, prompt, len(ref), stop_at_eos=True)
        ref = ref[: len(ours)]  # HF keeps going after <|im_end|>; we stop there
        print(f"smollm2 native: {len(ours)} tokens, ours={ours} ref={ref}")
        assert len(ours) >= 8
        assert ours == ref
    assert sum(len(r) for r in refs) >= 16


def test_gemma_float32_greedy_matches_hf():
    """Same weights as the reference (exact dequantization): identical greedy tokens."""
    lm = real_model(GEMMA, "float32")
    prompt = _prompts(GEMMA)[0]
    (ref,) = hf_reference(GEMMA, [prompt])
    ours = greedy(lm, prompt, len(ref))
    print(f"gemma float32: ours={ours}\n               ref ={ref}")
    assert ours == ref
    assert (
        real_model(GEMMA).tokenizer.decode(ours).startswith(" the capital of the country of France")
    )


def test_gemma_native_tracks_hf():
    """Native keeps Q4_K/Q5_0/Q8_0 exact but requantizes Q6_K (16-wide sub-blocks) to MLX
    8-bit, so a near-tie may flip; where our argmax differs from the reference's token, the
    reference token must be within a hair of our best."""
    lm = real_model(GEMMA)
    prompt = _prompts(GEMMA)[0]
    (ref,) = hf_reference(GEMMA, [prompt])
    prefix, worst_gap = teacher_forced_report(lm, prompt, ref)
    print(f"gemma native: first {prefix}/{len(ref)} tokens agree; worst logit gap {worst_gap:.4f}")
    assert prefix >= 10
    assert worst_gap < 0.05
