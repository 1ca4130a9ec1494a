"""Settings: defaults < YAML file < ``MARKBASE_*`` environment < CLI flags.

The YAML file (``--config FILE`` or ``MARKBASE_CONFIG``; see configs/default.yaml)
has two sections, ``server`` (``ServerSettings`` below) and ``engine``
(``engine.config.EngineConfig``, with ``models`` a list of ``ModelConfig``).
Every scalar field of both can be set from the environment as
``MARKBASE_<FIELD>`` (``MARKBASE_PORT``, ``MARKBASE_MAX_NUM_SEQS``); lists are
comma-separated. Two short names: ``MARKBASE_MODEL`` (model sources, comma-
separated, replacing the models list) and ``MARKBASE_API_KEY`` (= api_keys).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine import envs
from engine.config import EngineConfig, ModelConfig

ENV_PREFIX = "MARKBASE_"


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no auth
    metrics_require_auth: bool = False
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    max_n: int = 8  # most choices one request may ask for
    max_prompts: int = 32  # most prompts in one /v1/completions request
    max_tokens_limit: int = 0  # largest max_tokens a request may ask for, 0 = the context window
    max_messages: int = 2048  # most messages in one /v1/chat/completions request
    max_prompt_chars: int = 1_000_000  # characters of prompt text (all messages or prompts)
    request_timeout_s: float = 600.0  # wall clock per request, 0 = none
    stream_keepalive_s: float = 15.0  # SSE comment after this long without a token
    shutdown_grace_s: float = 5.0  # on SIGINT/SIGTERM, in-flight requests get this long
    cors_origins: list[str] = field(default_factory=list)  # empty: no CORS headers
    log_level: str = "info"
    log_requests: bool = True  # one JSON line per request on logger markbase.access
    # Connection limits, enforced per connection by server.connections (0 = off).
    header_timeout_s: float = 10.0  # request line + headers must all arrive within this
    body_timeout_s: float = 20.0  # a request body gets this long, plus 1 s per ...
    body_min_rate_bytes: int = 1024  # ... this many bytes received (0: a hard deadline)
    keepalive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1024  # open at once; beyond: 503 + Retry-After, then closed
    max_connections_per_client: int = 128  # per client IP; beyond: 429 (0 behind a proxy)
    max_header_bytes: int = 16384  # request line + headers; beyond: 431
    # Refusal throttle (server.refusals): an address whose refused requests (4xx) add up
    # to this many bytes in refusal_window_s has its next requests held refusal_delay_s,
    # then 429 (0: off; behind a proxy, where every client has its address).
    refused_bytes_per_client: int = 16 * 1024 * 1024
    refusal_window_s: float = 10.0
    refusal_delay_s: float = 1.0
    # Prompt tokenizing (server.prompt_guard).
    large_prompt_bytes: int = 65536  # prompts this long are tokenized a few at a time ...
    max_large_tokenizations: int = 2  # ... this many, as many waiting; beyond: 429


@dataclass
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    engine: EngineConfig = field(default_factory=EngineConfig)


class ConfigError(ValueError):
    """A setting could not be read; the message names the source and the key."""


# --------------------------------------------------------------------------- coercion


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` (from YAML or an env string) as the field's type."""
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        return _coerce(value, args[0], where)
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], where) for v in value] if args else value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if hint is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _apply(obj: Any, values: Mapping[str, Any], where: str) -> None:
    hints = _hints(type(obj))
    for key, value in values.items():
        if key not in hints:
            known = ", ".join(_field_names(type(obj)))
            raise ConfigError(f"{where}: unknown setting {key!r} (known: {known})")
        setattr(obj, key, _coerce(value, hints[key], f"{where}.{key}"))


def _model(value: Any, where: str) -> ModelConfig:
    if isinstance(value, str):
        return parse_model_arg(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: a model is a source string or a mapping, got {value!r}")
    m = ModelConfig()
    _apply(m, value, where)
    return m


def parse_model_arg(arg: str) -> ModelConfig:
    """``SRC`` or ``NAME=SRC`` (NAME is the id clients send)."""
    name, sep, source = arg.partition("=")
    if sep and name and "/" not in name and source:
        return ModelConfig(source=source, name=name)
    return ModelConfig(source=arg)


# --------------------------------------------------------------------------- layers


def _apply_yaml(settings: Settings, path: Path) -> None:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with 'server' and 'engine' sections")
    unknown = set(data) - {"server", "engine"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown section(s) {sorted(unknown)}; use 'server' and 'engine'"
        )
    _apply(settings.server, data.get("server") or {}, f"{path}:server")
    engine = dict(data.get("engine") or {})
    models = engine.pop("models", None)
    _apply(settings.engine, engine, f"{path}:engine")
    if models is not None:
        if not isinstance(models, list) or not models:
            raise ConfigError(f"{path}:engine.models: expected a non-empty list")
        settings.engine.models = [
            _model(m, f"{path}:engine.models[{i}]") for i, m in enumerate(models)
        ]


def _apply_env(settings: Settings, env: Mapping[str, str] | None) -> None:
    """The ``MARKBASE_*`` settings set in ``env`` (None: the process's), read through
    engine/envs.py's registry, which declares each of them."""
    for target in (settings.server, settings.engine):
        hints = _hints(type(target))
        for name in _field_names(type(target)):
            if name == "models":
                continue
            key = ENV_PREFIX + name.upper()
            text = envs.raw(key, env)
            if text is not None:
                setattr(target, name, _coerce(text, hints[name], key))
    keys = envs.raw(ENV_PREFIX + "API_KEY", env)
    if keys is not None:
        settings.server.api_keys = _coerce(keys, list[str], "MARKBASE_API_KEY")
    models = envs.raw(ENV_PREFIX + "MODEL", env)
    if models is not None:
        sources = [s.strip() for s in models.split(",") if s.strip()]
        if sources:
            settings.engine.models = [parse_model_arg(s) for s in sources]


def setting_env_vars() -> set[str]:
    """Every MARKBASE_* variable this module reads (others, such as the loader's
    MARKBASE_CACHE_DIR, belong to other parts)."""
    names = {f.name for cls in (ServerSettings, EngineConfig) for f in dataclasses.fields(cls)}
    names.discard("models")
    return {ENV_PREFIX + n.upper() for n in names} | {
        ENV_PREFIX + "API_KEY",
        ENV_PREFIX + "MODEL",
        ENV_PREFIX + "CONFIG",
    }


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build settings from all layers. ``overrides`` are CLI values already
    parsed: keys are field names of ServerSettings or EngineConfig, plus
    ``models`` (list of ModelConfig); ``None`` values mean "not given"."""
    settings = Settings()
    path = config_path or envs.raw(ENV_PREFIX + "CONFIG", env)
    if path:
        _apply_yaml(settings, Path(path))
    _apply_env(settings, env)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key == "models":
            settings.engine.models = list(value)
        elif key in _hints(ServerSettings):
            _apply(settings.server, {key: value}, "flag")
        elif key in _hints(EngineConfig):
            _apply(settings.engine, {key: value}, "flag")
        else:
            raise ConfigError(f"unknown setting {key!r}")
    validate(settings)
    return settings


def validate(settings: Settings) -> None:
    s = settings.server
    if not 0 < s.port < 65536:
        raise ConfigError(f"port must be 1..65535, got {s.port}")
    if s.max_body_bytes < 1024:
        raise ConfigError(f"max_body_bytes must be at least 1024, got {s.max_body_bytes}")
    for name in ("max_n", "max_prompts", "max_messages", "max_prompt_chars"):
        if getattr(s, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(s, name)}")
    for name in (
        "header_timeout_s",
        "body_timeout_s",
        "body_min_rate_bytes",
        "keepalive_timeout_s",
        "max_connections",
        "max_connections_per_client",
        "refused_bytes_per_client",
        "refusal_delay_s",
    ):
        if getattr(s, name) < 0:
            raise ConfigError(f"{name} must be 0 (off) or more, got {getattr(s, name)}")
    if s.refusal_window_s <= 0:
        raise ConfigError(f"refusal_window_s must be more than 0, got {s.refusal_window_s}")
    if s.max_header_bytes < 1024:
        raise ConfigError(f"max_header_bytes must be at least 1024, got {s.max_header_bytes}")
    if s.large_prompt_bytes < 1 or s.max_large_tokenizations < 1:
        raise ConfigError(
            "large_prompt_bytes and max_large_tokenizations must be at least 1, got "
            f"{s.large_prompt_bytes} and {s.max_large_tokenizations}"
        )
    if s.max_tokens_limit < 0:
        raise ConfigError(f"max_tokens_limit must be 0 (none) or more, got {s.max_tokens_limit}")
    if any(not k for k in s.api_keys):
        raise ConfigError("api_keys must not contain empty keys")
    if not settings.engine.models:
        raise ConfigError("no model to serve: give --model SRC or set engine.models")
    names = [model_name(m) for m in settings.engine.models]
    if len(set(names)) != len(names):
        raise ConfigError(f"two models would have the same name: {names}; set name: for one")


def model_name(m: ModelConfig) -> str:
    """The id a model will be served under, as documented on ModelConfig.name (the
    engine decides for real; this is only for the duplicate check and logs)."""
    if m.name:
        return m.name
    path = Path(m.source.rstrip("/"))
    return path.stem if m.source.endswith(".gguf") else path.name


def redacted(settings: Settings) -> dict[str, Any]:
    """Settings as a dict for logs, API keys replaced by their count."""
    d = dataclasses.asdict(settings)
    d["server"]["api_keys"] = f"<{len(settings.server.api_keys)} key(s)>"
    return d
