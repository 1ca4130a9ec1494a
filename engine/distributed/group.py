"""Joining the ranks of a tensor-parallel model and sharding it, the same on every rank.

The backend: MLX's ring (TCP) on CPUs and Macs, NCCL on NVIDIA GPUs (with NVLink
multicast off: ``NCCL_NVLS_ENABLE=0``). The sharding is mlx-lm's own ``Model.shard``
(attention heads and MLP columns split across ranks, an all-reduce after the output
and down projections; MoE experts split inside each expert's FFN), so a family is
tensor-parallel exactly where mlx-lm implements ``shard``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to join the group (passed to followers as JSON)."""

    rank: int
    size: int
    backend: str  # "ring" | "nccl"
    hostfile: str  # ring: JSON list of [["127.0.0.1:port"], ...]; nccl: unused
    nccl_port: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


def write_hostfile(path: Path, ports: list[int]) -> None:
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))


def rank_env(spec: RankSpec) -> dict[str, str]:
    """The environment MLX's distributed backends read to join ``spec``'s group."""
    env = {"MLX_RANK": str(spec.rank), "MLX_WORLD_SIZE": str(spec.size)}
    if spec.backend == "ring":
        env["MLX_HOSTFILE"] = spec.hostfile
    else:
        env.update(
            NCCL_HOST_IP="127.0.0.1",
            NCCL_PORT=str(spec.nccl_port),
            NCCL_NVLS_ENABLE="0",  # NVLink multicast off
        )
    return env


def join_group(spec: RankSpec):
    """Initialises MLX's distributed group for this process's rank."""
    os.environ.update(rank_env(spec))
    import mlx.core as mx

    if spec.backend == "nccl":
        mx.set_default_device(mx.Device(mx.gpu, spec.rank))
    group = mx.distributed.init(backend=spec.backend, strict=True)
    if group.size() != spec.size or group.rank() != spec.rank:
        raise RuntimeError(
            f"joined a group of {group.size()} as rank {group.rank()}, "
            f"expected {spec.size} / {spec.rank}"
        )
    return group


class ShardError(ValueError):
    """The model cannot be split across ranks (family without sharding, or sizes that
    do not divide)."""


def shard_model(loaded, group) -> None:
    """Splits ``loaded.model`` in place across ``group`` (mlx-lm's ``Model.shard``)."""
    model = loaded.model
    n = group.size()
    if not hasattr(model, "shard"):
        raise ShardError(
            f"tensor parallelism is not available for the '{loaded.architecture}' family "
            "(its mlx-lm module defines no shard())"
        )
    args = getattr(model, "args", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(args, field, None)
        if isinstance(value, int) and value % n:
            raise ShardError(
                f"tensor parallelism over {n} ranks needs {field} divisible by {n}; "
                f"'{loaded.name}' has {value}"
            )
    model.shard(group)
    import mlx.core as mx

    mx.eval(model.parameters())
