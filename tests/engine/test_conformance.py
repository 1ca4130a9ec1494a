"""Conformance over mlx-lm's architectures: every text model family in ``mlx_lm.models``,
built tiny with random weights (tests/helpers/families.py), decodes through the engine
exactly as mlx-lm's own ``generate_step`` does on the same weights.

For each family, five prompts (3 to 40 tokens), 20 greedy tokens each:

- alone: one request at a time through ``EngineClient`` (prefix cache on: E starts
  with D's first block and reuses it, state layers included);
- batched: three prompts sent together (the two short ones prefilled together in one
  right-padded forward, where the family allows it), two more joining while they
  decode (E continuing a cached prefix; both prefilled in 16-token chunks beside the
  decoding rows); rows leave as they finish.

Both must equal mlx-lm's tokens. A family the engine cannot serve must be refused
when it is loaded (``ModelLoadError`` naming the family), never fail mid-request.
The table of results is printed at the end (``REFUSED`` and ``NOT_BUILT`` say why).
"""

from __future__ import annotations

import asyncio
import importlib
import time
from dataclasses import dataclass

import mlx.core as mx
import pytest

from engine.client import EngineClient
from engine.config import EngineConfig
from engine.loading import ModelLoadError, build_random_model
from engine.model import attention
from engine.types import GenerationRequest, SamplingParams
from tests.helpers.families import NOT_BUILT, families, tiny_config

pytestmark = pytest.mark.slow

N_TOKENS = 20
_D = [(i * 37 + 11) % 250 + 1 for i in range(29)]
PROMPTS = {
    "A": [5, 17, 200, 3, 9],
    "B": [42, 42, 7],
    "D": _D,
    "E": _D[:20] + [(i * 7 + 3) % 250 + 1 for i in range(20)],  # D's first block, then new
    "F": [(i * 53 + 29) % 250 + 1 for i in range(35)],
}
TOGETHER, JOINING = ("A", "B", "D"), ("E", "F")

# Families the engine must serve (the list).
MUST_PASS = frozenset(
    {
        "gemma4_text",
        "gemma3n",
        "gemma3_text",
        "llama",
        "qwen3",
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
        "qwen3_next",
        "qwen3_5",
        "deepseek_v3",
        "phi3",
        "granitemoe",
        "olmoe",
    }
)

# Families the engine refuses at load, and a phrase the refusal names: the cache (or
# the device) it lacks. A family that starts to pass must leave this table.
REFUSED: dict[str, str] = {
    # its KV-reusing layers take RoPE positions from the cache's time length, which
    # left padding in the batch changes
    "afm7": "a batched decode step differs",
    "bitnet": "cannot run on this device",  # a Metal-only kernel
    "deepseek_v41": "deepseek_v41.LayerCache",
    "gpt_bigcode": "Only length-1 arrays",  # positions from an int offset, not one per row
    "llama4": "ChunkedKVCache",
    # its n-gram embedding keeps each row's recent token ids, of different lengths
    "longcat_flash_ngram": "concatenate",
    "muse_spark": "cannot run on this device",  # a Metal-only kernel
    "plamo3": "masks a window of 9 positions over a sliding-window cache of 8",
}


@dataclass
class Result:
    family: str
    status: str  # pass | fail | not supported | not built
    detail: str = ""
    seconds: float = 0.0


RESULTS: dict[str, Result] = {}


def reference(model, prompt: list[int]) -> list[int]:
    """mlx-lm's own greedy generation (``generate_step``, argmax sampling)."""
    from mlx_lm.generate import generate_step

    with attention.original():  # not the engine's decode attention, where installed
        steps = generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=N_TOKENS)
        return [int(tok) for tok, _ in steps]


_ids = iter(range(10**9))


async def generate(client, model: str, prompt: list[int], progress=None) -> list[int]:
    req = GenerationRequest(
        request_id=f"c{next(_ids)}",
        model=model,
        prompt_tokens=list(prompt),
        params=SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True),
    )
    out: list[int] = []
    async for ev in client.generate(req):
        if ev.error:
            raise RuntimeError(f"failed mid-request: {ev.error}")
        out.extend(ev.token_ids)
        if progress is not None and len(out) >= 5:
            progress.set()
    return out


async def batched(client, model: str) -> dict[str, list[int]]:
    started = asyncio.Event()
    first = {
        k: asyncio.create_task(generate(client, model, PROMPTS[k], started if k == "A" else None))
        for k in TOGETHER
    }
    await asyncio.wait_for(started.wait(), 60)
    later = {k: asyncio.create_task(generate(client, model, PROMPTS[k])) for k in JOINING}
    tasks = {**first, **later}
    done = await asyncio.gather(*tasks.values())
    return dict(zip(tasks, done))


def check(family: str, pipeline: bool | None = None) -> Result:
    """One family's result; ``pipeline``: the decode loop's mode (None: the backend's
    default, step by step on a CPU; True: step i+1 queued before step i is read, as on
    a GPU)."""
    if family in NOT_BUILT:
        return Result(family, "not built", NOT_BUILT[family])
    loaded = build_random_model(family, tiny_config(family), seed=0)
    try:
        want = {k: reference(loaded.model, p) for k, p in PROMPTS.items()}
    except Exception as exc:  # mlx-lm itself cannot run it here
        want = None
        why = f"{type(exc).__name__}: {exc}"
    config = EngineConfig(
        max_num_seqs=8,
        prefill_chunk_tokens=16,
        prefix_cache_tokens=4096,
        warmup=False,
        pipeline_decode=pipeline,
    )
    try:
        client = EngineClient.from_loaded([(loaded, None)], config)
    except ModelLoadError as exc:
        return Result(family, "not supported", str(exc))
    if want is None:
        client.shutdown()
        return Result(family, "fail", f"loaded although mlx-lm cannot run it ({why})")
    worker = client.worker(loaded.name)
    try:
        alone = {k: asyncio.run(generate(client, loaded.name, p)) for k, p in PROMPTS.items()}
        together = asyncio.run(batched(client, loaded.name))
    except Exception as exc:
        return Result(family, "fail", str(exc))
    finally:
        client.shutdown()
    for k in PROMPTS:
        for what, got in (("alone", alone[k]), ("batched", together[k])):
            if got != want[k]:
                at = next(i for i, (a, b) in enumerate(zip(got + [-1], want[k])) if a != b)
                return Result(
                    family, "fail", f"prompt {k} {what} differs from mlx-lm at token {at}"
                )
    if not worker.prefix_cache.hit_tokens:
        return Result(family, "fail", "no prompt reused a cached prefix")
    runner = worker.runner
    together_note = "prompts prefilled together" if runner.can_prefill_together() else "one by one"
    return Result(family, "pass", f"{runner.layout.describe()}; {together_note}")


def _importable(family: str) -> bool:
    try:
        importlib.import_module(f"mlx_lm.models.{family}")
    except BaseException:  # olmo exits on import without its package
        return False
    return True


@pytest.mark.parametrize("family", families())
def test_family(family: str) -> None:
    t0 = time.monotonic()
    if family not in NOT_BUILT and not _importable(family):
        pytest.fail(f"{family}: cannot import mlx_lm.models.{family}; add it to NOT_BUILT")
    result = check(family)
    result.seconds = time.monotonic() - t0
    RESULTS[family] = result
    if result.status == "fail":
        pytest.fail(f"{family}: {result.detail}")
    if result.status == "not supported":
        assert family not in MUST_PASS, f"{family} must pass: {result.detail}"
        assert f"'{family}'" in result.detail, "the refusal must name the family"
        assert family in REFUSED, f"{family} is refused, not listed in REFUSED: {result.detail}"
        assert REFUSED[family] in result.detail, result.detail
    if result.status == "pass":
        assert family not in REFUSED, f"{family} passes now: remove it from REFUSED"


@pytest.mark.parametrize("family", ["gemma4_text", "qwen3_next", "deepseek_v3"])
def test_pipelined_decode(family: str) -> None:
    """The GPU's decode loop (step i+1 built on step i's tokens before they are read)
    over a sliding window, state layers and MLA latents, on the CPU."""
    result = check(family, pipeline=True)
    assert result.status == "pass", result.detail


def test_table(capsys) -> None:
    """The table of families (after ``test_family`` ran for each)."""
    if not RESULTS:
        pytest.skip("no family was checked in this run")
    lines = [f"{'family':24} {'result':14} reason"]
    for family in sorted(RESULTS):
        r = RESULTS[family]
        lines.append(f"{family:24} {r.status:14} {r.detail}")
    counts = {
        s: sum(r.status == s for r in RESULTS.values())
        for s in ("pass", "not supported", "not built", "fail")
    }
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    missing = sorted(f for f in MUST_PASS if f in RESULTS and RESULTS[f].status != "pass")
    assert not missing, f"must pass: {missing}"
