"""The one tolerance definition the tests (and the random sweep) compare results with.

A result ``a`` matches a reference ``b`` when ``max|a - b| <= atol + rtol * max|b|``: the
error is measured against the reference's scale (an element-wise relative error blows up
on the many entries near zero). Each dtype has an absolute and a relative part; bf16's is
mostly relative (its absolute error grows with the values' magnitude), and its small
absolute floor is for results that are zero but for rounding: with k=1 and
normalize_weights the combine weight is exactly 1, so the router's gradient is fp32 noise
of order 1e-7 against a reference that is noise too (the sweep's seed 202 drew two).

Why these numbers: the router's logits, scores and combine weights are fp32 whatever the
layer's dtype (the router contract), so an fp64 layer is still fp32-accurate in its
weights; the distributed layer sums the same products in another order (partial sums
over expert-TP, the reverse all-to-all, the combine's scatter-add), a few fp32 ulps of
values of order 1. bf16 keeps 8 significant bits (relative step 2**-8 = 3.9e-3); a layer
output passes through two GEMMs, an activation and the weighted combine, each rounding.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def allowed(self, scale: float) -> float:
        """The largest absolute error accepted against a reference of max magnitude ``scale``."""
        return self.atol + self.rtol * scale


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(atol=1e-6, rtol=1e-6),
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.bfloat16: Tolerance(atol=1e-5, rtol=3e-2),
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The tolerance of results computed in ``dtype`` (float16 is treated like bfloat16)."""
    if dtype == torch.float16:
        dtype = torch.bfloat16
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance defined for dtype {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


def error_ratio(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """max|actual - expected| / allowed error: <= 1 passes. 0 for empty tensors."""
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if actual.numel() == 0:
        return 0.0
    a, b = actual.detach().double(), expected.detach().double()
    err = float((a - b).abs().max())
    if err != err:   # NaN anywhere
        return float("inf")
    allowed = tolerance(dtype).allowed(float(b.abs().max()))
    return err / allowed if allowed > 0 else (0.0 if err == 0 else float("inf"))


def is_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    return error_ratio(actual, expected, dtype) <= 1.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    """AssertionError naming ``what``, the error, the reference scale and the tolerance."""
    ratio = error_ratio(actual, expected, dtype)
    if not ratio <= 1.0:
        a, b = actual.detach().double(), expected.detach().double()
        tol = tolerance(dtype)
        raise AssertionError(f"{what}: max error {float((a - b).abs().max()):.3e} > atol {tol.atol:g} + rtol "
                             f"{tol.rtol:g} x reference scale {float(b.abs().max()):.3e} ({dtype})")
