"""The ``MARKBASE_*`` environment switches, each declared once with its type, default
and meaning; code reads them through these objects, never ``os.environ`` directly.

Why: A/B switches spread over many modules were read with ad-hoc parsing; a typo in a
value silently meant the default. Here every switch validates its value and names
itself in the error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """A switch with a fixed set of values; read at each ``get`` (tests may set it)."""

    name: str
    default: str
    choices: tuple[str, ...]
    help: str

    def get(self) -> str:
        value = os.environ.get(self.name, self.default)
        if value not in self.choices:
            raise ValueError(f"{self.name}={value!r}: want one of {', '.join(self.choices)}")
        return value


@dataclass(frozen=True)
class Int:
    """A switch holding a non-negative integer."""

    name: str
    default: int
    help: str

    def get(self) -> int:
        text = os.environ.get(self.name)
        if text is None:
            return self.default
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{self.name}={text!r}: want an integer") from None
        if value < 0:
            raise ValueError(f"{self.name}={text!r}: want an integer >= 0")
        return value


MOE = Choice(
    "MARKBASE_MOE",
    "grouped",
    ("grouped", "mlx"),
    "MoE expert products: grouped per expert (engine/model/moe.py) or mlx-lm's SwitchGLU as is",
)
MOE_KERNEL_TOKENS = Int(
    "MARKBASE_MOE_KERNEL_TOKENS",
    128,
    "CUDA: MoE layers of at most this many tokens take the grouped 4-bit kernels "
    "(engine/backends/cuda/products/moe.py); larger chunks dequantize the experts",
)

REGISTRY = {s.name: s for s in (MOE, MOE_KERNEL_TOKENS)}
