"""Every ``MARKBASE_*`` environment variable markbase reads: name, type, default, meaning.

One registry, so that a switch is documented where it is declared, a typo in a value is
an error that names the variable, and a variable that nothing reads (a misspelt name, a
switch that was removed) is a warning when ``markbase serve`` starts instead of a silent
no-op. Modules read switches through ``value(name)`` (or ``envs.MARKBASE_X``), never
through ``os.environ``; ``tests/engine/test_envs.py`` checks that.

Reads happen when called, not at import: tests and benchmarks change a switch between
calls, and the code reads it where it always did (some modules keep what they read for
the life of the process; their docstrings say so).

``python -m engine.envs --markdown`` writes docs/configuration.md from this file.

Imports no MLX: the HTTP server imports it too.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "MARKBASE_"


@dataclass(frozen=True)
class Switch:
    """One environment variable. ``kind``: ``bool``, ``int``, ``float``, ``str``, or
    ``choice`` (a ``str`` that must be one of ``choices``). ``default`` is what ``value``
    returns when the variable is unset (None: decided by the code that reads it, as
    ``default_doc`` says). ``section`` groups the generated documentation."""

    name: str
    kind: str
    default: Any
    doc: str
    section: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    default_doc: str = ""

    def parse(self, text: str) -> Any:
        """``text`` as this switch's type; ValueError naming the variable otherwise."""
        if self.kind == "bool":
            if text in ("0", "1"):
                return text == "1"
            raise ValueError(f"{self.name}={text!r}: want 0 or 1")
        if self.kind == "choice":
            if text not in self.choices:
                *rest, last = self.choices
                want = f"{', '.join(rest)} or {last}" if rest else last
                raise ValueError(f"{self.name}={text!r}: want {want}")
            return text
        if self.kind in ("int", "float"):
            try:
                number = int(text.strip()) if self.kind == "int" else float(text.strip())
            except ValueError:
                raise ValueError(
                    f"{self.name}={text!r}: want {'an integer' if self.kind == 'int' else 'a number'}"
                ) from None
            if self.minimum is not None and number < self.minimum:
                raise ValueError(f"{self.name}={text!r}: want at least {self.minimum:g}")
            return number
        return text


def _s(name, kind, default, doc, section, choices=(), minimum=None, default_doc=""):
    return Switch(PREFIX + name, kind, default, doc, section, tuple(choices), minimum, default_doc)


SERVER = "Server settings"
ENGINE = "Engine settings"
RUNTIME = "Engine"
LOADING = "Model loading"
CPU = "CPU backend"
CUDA = "CUDA backend"
TESTS = "Tests and benchmarks"

# The settings of server/config.py (ServerSettings, engine.config.EngineConfig):
# defaults < YAML file < these variables < command-line flags. server/config.py coerces
# and validates them as it does the YAML file's values; their defaults are the dataclass
# fields' (tests/engine/test_envs.py checks the two lists agree).
# fmt: off
_SETTINGS = [
    _s("CONFIG", "str", None, "YAML settings file (sections `server` and `engine`; configs/default.yaml)", SERVER, default_doc="none"),
    _s("MODEL", "str", None, "models to serve, comma-separated (`SRC` or `NAME=SRC`): replaces the models list", SERVER, default_doc="smollm2-135m-instruct"),
    _s("HOST", "str", "127.0.0.1", "address to listen on", SERVER),
    _s("PORT", "int", 8000, "port to listen on", SERVER),
    _s("API_KEY", "str", None, "API keys, comma-separated (= `api_keys`); none: no auth", SERVER, default_doc="none"),
    _s("API_KEYS", "str", None, "the same as MARKBASE_API_KEY", SERVER, default_doc="none"),
    _s("METRICS_REQUIRE_AUTH", "bool", False, "/metrics asks for an API key too", SERVER),
    _s("MAX_BODY_BYTES", "int", 4 * 1024 * 1024, "larger request bodies get 413", SERVER),
    _s("MAX_N", "int", 8, "most choices one request may ask for", SERVER),
    _s("MAX_PROMPTS", "int", 32, "most prompts in one /v1/completions request", SERVER),
    _s("MAX_TOKENS_LIMIT", "int", 0, "largest max_tokens a request may ask for (0: the context window)", SERVER),
    _s("MAX_MESSAGES", "int", 2048, "most messages in one /v1/chat/completions request", SERVER),
    _s("MAX_PROMPT_CHARS", "int", 1000000, "characters of prompt text in one request", SERVER),
    _s("REQUEST_TIMEOUT_S", "float", 600.0, "wall clock a request may take (0: none)", SERVER),
    _s("STREAM_KEEPALIVE_S", "float", 15.0, "an SSE comment after this long without a token", SERVER),
    _s("SHUTDOWN_GRACE_S", "float", 5.0, "on SIGINT/SIGTERM, requests in flight get this long", SERVER),
    _s("CORS_ORIGINS", "str", None, "allowed CORS origins, comma-separated (none: no CORS headers)", SERVER, default_doc="none"),
    _s("LOG_LEVEL", "str", "info", "log level", SERVER),
    _s("LOG_REQUESTS", "bool", True, "one JSON line per request on logger markbase.access", SERVER),
    _s("HEADER_TIMEOUT_S", "float", 10.0, "request line and headers must all arrive within this (docs/security.md)", SERVER),
    _s("BODY_TIMEOUT_S", "float", 20.0, "a request body gets this long, plus 1 s per body_min_rate_bytes received", SERVER),
    _s("BODY_MIN_RATE_BYTES", "int", 1024, "bytes a second a slow body must keep up (0: a hard deadline)", SERVER),
    _s("KEEPALIVE_TIMEOUT_S", "float", 5.0, "an idle keep-alive connection is closed after this", SERVER),
    _s("MAX_CONNECTIONS", "int", 1024, "connections open at once; beyond: 503 + Retry-After, then closed", SERVER),
    _s("MAX_CONNECTIONS_PER_CLIENT", "int", 128, "connections per client address; beyond: 429 (0: no cap, behind a proxy)", SERVER),
    _s("MAX_HEADER_BYTES", "int", 16384, "request line and headers; beyond: 431", SERVER),
    _s("REFUSED_BYTES_PER_CLIENT", "int", 16 * 1024 * 1024, "bytes of refused (4xx) requests a client address may send in REFUSAL_WINDOW_S; beyond, its requests are held, then 429 (0: off, behind a proxy)", SERVER),
    _s("REFUSAL_WINDOW_S", "float", 10.0, "the window of REFUSED_BYTES_PER_CLIENT", SERVER),
    _s("REFUSAL_DELAY_S", "float", 1.0, "how long a throttled address's request is held, its body unread, before its 429", SERVER),
    _s("LARGE_PROMPT_BYTES", "int", 65536, "prompts this long are tokenized a few at a time, off the event loop", SERVER),
    _s("MAX_LARGE_TOKENIZATIONS", "int", 2, "large prompts tokenized at once (as many may wait; beyond: 429)", SERVER),
    _s("MAX_NUM_SEQS", "int", 16, "sequences decoded together in one step", ENGINE),
    _s("MAX_QUEUED_REQUESTS", "int", 256, "requests waiting beyond this get 429", ENGINE),
    _s("MAX_KV_TOKENS", "int", 65536, "KV tokens held by running sequences, all together", ENGINE),
    _s("PREFILL_CHUNK_TOKENS", "int", None, "prompt tokens prefilled a step (chunked prefill)", ENGINE, default_doc="2048 on a GPU, 128 on the CPU"),
    _s("PREFIX_CACHE_TOKENS", "int", 32768, "KV tokens kept for prefix reuse (LRU), 0: off", ENGINE),
    _s("QUEUE_TIMEOUT_S", "float", 30.0, "a request waiting longer for a slot gets 429", ENGINE),
    _s("DEFAULT_MAX_TOKENS", "int", 512, "max_tokens of a request that gives none", ENGINE),
    _s("WARMUP", "bool", None, "compile kernels and traces before serving", ENGINE, default_doc="on on a GPU, off on the CPU"),
    _s("PIPELINE_DECODE", "bool", None, "build step i+1 before step i's tokens are read back", ENGINE, default_doc="on on a GPU, off on the CPU"),
    _s("TENSOR_PARALLEL", "int", 1, "ranks one model is split over (docs/distributed.md)", ENGINE),
]

_SWITCHES = [
    _s("PREFILL_ASYNC", "bool", None, "queue a prompt chunk whose logits nobody wants instead of waiting on it (engine/runner.py)", RUNTIME, default_doc="on on a GPU, off on the CPU"),
    _s("PREFILL_TOGETHER", "bool", True, "the rest of several prompts in one forward when the output layer is known (engine/runner.py)", RUNTIME),
    _s("MOE", "choice", "grouped", "MoE expert products: grouped per expert (engine/model/moe.py) or mlx-lm's own `SwitchGLU` (`mlx`)", RUNTIME, ("grouped", "mlx")),
    _s("MOE_KERNEL_TOKENS", "int", 128, "CUDA: MoE layers of at most this many tokens take the grouped 4-bit kernels (engine/backends/cuda/products/moe.py), larger chunks dequantize the experts", CUDA, minimum=0),
    _s("CPU_STEP", "choice", "native", "the CPU's decode step: `native` (llama layers in one C call: engine/backends/cpu/native_step.py; other layers take the lean one), `lean` (engine/backends/cpu/step.py) or `fused` (engine/model/decode_step.py)", RUNTIME, ("native", "lean", "fused")),
    _s("CACHE_DIR", "str", None, "where converted models, the BLAS shim and other caches go", LOADING, default_doc="~/.cache/markbase"),
    # ------------------------------------------------------------------ CPU
    _s("BLAS", "choice", "auto", "bind MLX's CPU matmuls to a fast system BLAS (`auto`) or leave MLX's reference BLAS (`off`)", CPU, ("auto", "off", "0", "none", "vendored")),
    _s("BLAS_LIB", "str", None, "path of the BLAS library to bind (exporting cblas_sgemm)", CPU, default_doc="the system OpenBLAS"),
    _s("BLAS_GEMV", "choice", "1", "send one-row sgemm calls to sgemv through the C shim (`0`/`off`: not)", CPU, ("1", "0", "off")),
    _s("BLAS_GEMV_THREADS", "int", 0, "BLAS threads for one-row products (0: OPENBLAS_NUM_THREADS)", CPU, minimum=0),
    _s("BLAS_SMALL_GEMM_THREADS", "int", 1, "BLAS threads for products of 2 to MARKBASE_BLAS_SMALL_M - 1 rows", CPU, minimum=0),
    _s("BLAS_GEMM_THREADS", "int", 0, "BLAS threads for larger products (0: OPENBLAS_NUM_THREADS)", CPU, minimum=0),
    _s("BLAS_SMALL_M", "int", 16, "rows below which a product is small", CPU, minimum=1),
    _s("BLAS_REEXEC", "bool", False, "set by markbase in the process it re-executes with LD_PRELOAD (internal)", CPU),
    _s("BLAS_REAL", "str", None, "set by markbase: the library the preloaded shim forwards to (internal; read by the C shim)", CPU, default_doc="none"),
    _s("QGEMM", "choice", "1", "the CPU's 4-bit decode products from quantized copies (engine/backends/cpu/qgemm.py): `1`, `0`, or `force` (also without AVX2)", CPU, ("1", "0", "on", "off", "no", "force")),
    _s("QGEMM_MAX_M", "int", 16, "most rows a quantized decode product takes", CPU, minimum=0),
    _s("QGEMM_THREADS", "int", 0, "threads of the quantized products (0: every CPU of the process)", CPU, minimum=0),
    _s("QGEMM_SPIN_US", "int", 30, "microseconds its worker threads spin before sleeping", CPU, minimum=0),
    _s("QGEMM_INT8", "bool", False, "inputs as int8 blocks (llama.cpp's Q8_1 numerics, not the model's own): 1.2-1.3x single-stream decode (docs/performance.md)", CPU),
    # ------------------------------------------------------------------ CUDA
    _s("GPU_FLOAT_PLAN", "str", "1:xwt,2:mma,33:xwt", "how float decode products run by rows, `ROWS:FORM,...` (engine/backends/cuda/linear.py)", CUDA),
    _s("GPU_QUANT_PLAN", "str", "1:qstream,2:qmma,33:qgemm", "how 4-bit decode products run by rows (engine/backends/cuda/linear.py)", CUDA),
    _s("GPU_DECODE_2D", "bool", True, "carry the decode step's hidden state as [B, D] (0: [B, 1, D])", CUDA),
    _s("GPU_JOINT_ROPE", "bool", True, "q and k through one RoPE call in the 2-D step", CUDA),
    _s("GPU_FOLD", "bool", True, "residual adds and SwiGLU inside the products", CUDA),
    _s("GPU_ATTENTION", "choice", "kernel", "decode attention: markbase's kernel or MLX's (`mlx`)", CUDA, ("kernel", "mlx")),
    _s("GPU_ROPE_APPEND", "bool", True, "RoPE and the KV write inside the attention kernel", CUDA),
    _s("GPU_STEP_COMPILE", "bool", True, "the whole decode step under one mx.compile", CUDA),
    _s("GPU_KERNEL_MINIFY", "bool", True, "strip comments and indentation from kernel sources before MLX compiles them", CUDA),
    _s("GPU_L2_PREFETCH", "bool", True, "at one row, o_proj's and gate/up's first weights asked into L2 beside the attention", CUDA),
    _s("GPU_L2_PREFETCH_MB", "float", 12.0, "megabytes of gate/up the L2 prefetch asks for", CUDA, minimum=0),
    _s("GPU_ATTN_LANES", "int", None, "decode attention loop shape: lanes a position", CUDA, default_doc="by shape"),
    _s("GPU_ATTN_U", "int", None, "decode attention loop shape: positions in flight a lane", CUDA, default_doc="by shape"),
    _s("GPU_ATTN_VEC", "int", None, "decode attention loop shape: vector width", CUDA, default_doc="by shape"),
    _s("GPU_ATTN_PPB", "int", None, "decode attention loop shape: positions a block", CUDA, default_doc="by shape"),
    _s("GPU_ATTN_WARPS", "int", None, "decode attention loop shape: warps a block", CUDA, default_doc="by shape"),
    _s("GPU_ATTN_TC", "bool", True, "tensor-core decode attention where it applies", CUDA),
    _s("GPU_ATTN_TC_SPLIT", "bool", True, "tensor-core form for launches split over time (few rows)", CUDA),
    _s("GPU_ATTN_TC_WARPS", "choice", "4", "warps a block of the tensor-core attention", CUDA, ("1", "2", "4", "8")),
    _s("GPU_ATTN_TC_SPLIT_WARPS", "choice", "8", "the same for its split form", CUDA, ("1", "2", "4", "8")),
    _s("GPU_ATTN_TC_BK", "choice", "16", "keys a tile of the tensor-core attention", CUDA, ("16", "32")),
    _s("GPU_ATTN_TC_STAGES", "choice", "2", "K/V tiles in flight a warp (fewer where shared memory is short)", CUDA, ("2", "3", "4")),
    _s("GPU_ATTN_TC_SPLIT_STAGES", "choice", "2", "the same for its split form", CUDA, ("2", "3", "4")),
    _s("GPU_PREFILL_ATTENTION", "choice", "kernel", "prompt-chunk attention: markbase's kernel or MLX's (`mlx`)", CUDA, ("kernel", "mlx")),
    _s("GPU_PREFILL_ATTN_STAGES", "choice", "2", "K/V tiles in flight in the prompt attention", CUDA, ("1", "2")),
    _s("GPU_PREFILL_ATTN_LDM", "bool", True, "the prompt attention's fragments by ldmatrix", CUDA),
    _s("GPU_PREFILL_DEQ_ROWS", "int", None, "prompt chunks of this many rows or more dequantize 4-bit weights and run a float matmul (0: off)", CUDA, minimum=0, default_doc="256"),
    _s("GPU_PREFILL_SMALL", "choice", "qmma", "4-bit products of smaller chunks: markbase's kernel or MLX's quantized_matmul (`mlx`)", CUDA, ("mlx", "qmma")),
    _s("GPU_PREFILL_STAGES", "int", 4, "a prompt chunk's forward queued every this many layers (0: off)", CUDA, minimum=0),
    _s("GPU_ROPE_DEVICE_OFFSET", "bool", True, "prompt chunks' RoPE offsets in device memory", CUDA),
    _s("GPU_DEQUANT", "bool", True, "prefill's 4-bit expansion by markbase's kernel (0: mx.dequantize)", CUDA),
    _s("GPU_MMA_MT", "int", 4, "most m-tiles a block of the tensor-core products", CUDA, minimum=1),
    _s("GPU_QSTREAM_FORM", "str", None, "the one-row 4-bit product's form (engine/backends/cuda/products/qstream.py)", CUDA, default_doc="by shape"),
    _s("GPU_QSTREAM_EARLY", "bool", True, "the one-row product's first loads before its barrier", CUDA),
    _s("GPU_QSTREAM_NORM", "bool", True, "the RMSNorm before a one-row product inside its kernel", CUDA),
    _s("GPU_QGEMM_PAIR_WARPS", "choice", "8", "warps a block pair of the many-row 4-bit product", CUDA, ("4", "8")),
    _s("GPU_QGEMM_STAGES", "choice", None, "buffers of x in the many-row 4-bit product", CUDA, ("2", "3"), default_doc="2 with 2 m-tiles a warp, else 3"),
    _s("GPU_QGEMM_LB", "int", 0, "blocks an SM the many-row 4-bit product is compiled for (0: no bound)", CUDA, minimum=0),
    _s("GPU_QGEMM_PLAIN", "bool", True, "plain (not SwiGLU) products on the many-row kernel where wide enough", CUDA),
    _s("GPU_QGEMM_SK", "choice", "3", "stream-K for the many-row 4-bit product: 0 off, 1-2 forced forms, 3 where measured faster", CUDA, ("0", "1", "2", "3")),
    _s("GPU_WGMMA", "choice", "auto", "Hopper warpgroup products: `auto` where measured faster, `1` for 33-128 rows, `0` off", CUDA, ("auto", "0", "1")),
    _s("GPU_WGMMA_NX", "choice", "4", "buffers of x in the warpgroup product", CUDA, ("3", "4", "5")),
    _s("GPU_WGMMA_WG", "choice", "4", "warpgroups a block of the warpgroup product", CUDA, ("2", "4")),
    _s("GPU_WGMMA_WEARLY", "bool", True, "the warpgroup product's weight loads right after each k-step", CUDA),
    _s("GPU_SAMPLER_KERNEL", "bool", True, "the batched draw by markbase's kernel", CUDA),
    _s("GPU_SAMPLER_MIN_ROWS", "int", 8, "rows from which the draw uses the kernel (read once, at import)", CUDA, minimum=1),
    # ------------------------------------------------------------------ tests
    _s("GPU_TEST_ON_CPU", "bool", False, "tests/backends/cuda/test_gpu.py on a CPU too (CPU against CPU)", TESTS),
    _s("TEST_START_TIMEOUT", "float", 600.0, "seconds a test server may take to start", TESTS),
    _s("TEST_KEEP_LOGS", "bool", False, "keep test servers' logs", TESTS),
    _s("REFERENCE_RECOMPUTE", "bool", False, "recompute the PyTorch reference tokens", TESTS),
    _s("FUZZ_EXAMPLES", "int", 100, "examples per operation of the API fuzz test", TESTS, minimum=1),
    _s("FUZZ_BUDGET_S", "float", 150.0, "seconds for the whole API fuzz test", TESTS, minimum=0),
    _s("BENCH_CACHE", "str", None, "where bench/peers.py keeps its downloads", TESTS, default_doc="~/.cache/markbase/bench"),
    _s("NO_MMA", "bool", False, "bench/gpu/profile_step.py: leave the tensor-core products out", TESTS),
]
# fmt: on

SWITCHES: dict[str, Switch] = {s.name: s for s in _SETTINGS + _SWITCHES}
SETTINGS: frozenset[str] = frozenset(s.name for s in _SETTINGS)
SECTIONS = (SERVER, ENGINE, RUNTIME, LOADING, CPU, CUDA, TESTS)


def switch(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not in engine/envs.py's registry") from None


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's text as set (None when unset); ``env`` defaults to the process's."""
    switch(name)
    return (os.environ if env is None else env).get(name)


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    """Whether the variable is set (to anything, even empty)."""
    return raw(name, env) is not None


def value(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The variable as its switch's type, or the switch's default when unset or empty."""
    s = switch(name)
    text = raw(name, env)
    if text is None or text == "":
        return s.default
    return s.parse(text)


def __getattr__(name: str) -> Any:
    """``envs.MARKBASE_GPU_FOLD``: ``value("MARKBASE_GPU_FOLD")``, read now."""
    if name in SWITCHES:
        return value(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unknown(env: Mapping[str, str] | None = None) -> list[str]:
    """``MARKBASE_*`` variables set in ``env`` that no switch declares, each with the
    closest known name where one is close."""
    env = os.environ if env is None else env
    out = []
    for name in sorted(env):
        if name.startswith(PREFIX) and name not in SWITCHES:
            near = difflib.get_close_matches(name, SWITCHES, n=1, cutoff=0.8)
            out.append(f"{name} (did you mean {near[0]}?)" if near else name)
    return out


def invalid(env: Mapping[str, str] | None = None) -> list[str]:
    """Why each set switch's value does not parse (settings are checked by
    server/config.py, which knows their types' layers)."""
    env = os.environ if env is None else env
    out = []
    for name, s in SWITCHES.items():
        text = env.get(name)
        if name in SETTINGS or text is None or text == "":
            continue
        try:
            s.parse(text)
        except ValueError as exc:
            out.append(str(exc))
    return out


def markdown() -> str:
    """docs/configuration.md."""
    lines = [
        "# Configuration",
        "",
        "<!-- generated by `python -m engine.envs --markdown` from engine/envs.py: edit that file -->",
        "",
        "Settings come from, in increasing priority: the defaults below, a YAML file",
        "(`--config FILE` or `MARKBASE_CONFIG`; configs/default.yaml), `MARKBASE_*`",
        "environment variables, and command-line flags (`markbase serve --help`).",
        "The other switches are environment variables only: backend choices and kernel",
        "forms, for A/B measurements. `markbase serve` warns about a `MARKBASE_*`",
        "variable it does not know and stops on a value it cannot read.",
        "",
        "Switches of type bool take `1` or `0`; the settings' booleans also true/false,",
        "yes/no, on/off.",
    ]
    for section in SECTIONS:
        rows = [s for s in SWITCHES.values() if s.section == section]
        lines += [
            "",
            f"## {section}",
            "",
            "| variable | type | default | what |",
            "|---|---|---|---|",
        ]
        for s in rows:
            kind = "/".join(s.choices) if s.kind == "choice" else s.kind
            if s.default_doc:
                default = s.default_doc
            elif s.kind == "bool":
                default = "1" if s.default else "0"
            else:
                default = "" if s.default is None else str(s.default)
            lines.append(f"| `{s.name}` | {kind} | {default} | {s.doc} |")
    return "\n".join(lines) + "\n"


DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m engine.envs", description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", nargs="?", const=str(DOC_PATH), metavar="PATH",
                    help=f"write the documentation (default {DOC_PATH.relative_to(DOC_PATH.parents[1])}; - for stdout)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.markdown is None:
        for s in SWITCHES.values():
            print(f"{s.name}={raw(s.name) or ''}" if is_set(s.name) else f"# {s.name}")
        return 0
    text = markdown()
    if args.markdown == "-":
        sys.stdout.write(text)
    else:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
