"""engine/backends/cuda/products/moe.py's kernels transcribed lane by lane in numpy
(tests/backends/cuda/emulation/moe.py) equal the dequantized products: the index logic
of the grouped expert kernels, checked on the CPU."""

from __future__ import annotations

import pytest

from tests.backends.cuda.emulation import moe as moe_emulation


@pytest.mark.cpu
@pytest.mark.parametrize(
    "tokens,top_k,experts,d,inter,gs,act",
    [
        (1, 2, 8, 64, 32, 32, "silu"),
        (5, 2, 8, 128, 64, 64, "gelu_tanh"),
        (20, 2, 4, 96, 32, 32, "silu"),
    ],
)
def test_emulated_kernels_equal_dequantized_products(tokens, top_k, experts, d, inter, gs, act):
    errs = moe_emulation.case(tokens, top_k, experts, d, inter, gs, act, seed=tokens)
    assert max(errs) < 1e-5, errs
