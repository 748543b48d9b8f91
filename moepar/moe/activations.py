"""Gated activations beyond plain SwiGLU, with hand-written backward for GroupedExperts.

Legend: N rows, F ffn hidden. ``h1 [N, F]`` is the gate pre-activation (x @ w1 + b1),
``h3 [N, F]`` the up pre-activation (x @ w3 + b3).

Clamped SwiGLU (GPT-OSS; limit 7.0, alpha 1.702 in its released config):
    g = clamp(h1, max=limit);  u = clamp(h3, -limit, limit)
    a = (u + 1) * g * sigmoid(alpha * g)
The clamps pass gradient where the input lies inside the closed bounds, as torch.clamp
does, so the hand-written backward equals autograd through ``clamped_swiglu_reference``.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import checks


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """The clamped SwiGLU's constants; ``forward``/``backward`` work on [N, F] blocks."""

    limit: float = 7.0
    alpha: float = 1.702

    def __post_init__(self) -> None:
        for name in ("limit", "alpha"):
            checks.finite(f"activation_{name}", getattr(self, name), above=0)

    def forward(self, h1: torch.Tensor, h3: torch.Tensor) -> torch.Tensor:
        """a [N, F] from the gate and up pre-activations (no autograd graph needed)."""
        g = h1.clamp(max=self.limit)
        return torch.sigmoid(g * self.alpha).mul_(g).mul_(h3.clamp(-self.limit, self.limit).add_(1.0))

    def backward(self, ga: torch.Tensor, h1: torch.Tensor, h3: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d h1, d h3) [N, F] from d a [N, F]."""
        lim, alpha = self.limit, self.alpha
        g = h1.clamp(max=lim)
        s = torch.sigmoid(g * alpha)
        glu = g * s
        # d glu / d g = s + alpha * g * s * (1 - s)
        dglu = s + alpha * glu * (1.0 - s)
        u1 = h3.clamp(-lim, lim) + 1.0
        gh1 = ga * u1 * dglu * (h1 <= lim)
        gh3 = ga * glu * ((h3 >= -lim) & (h3 <= lim))
        return gh1, gh3


def clamped_swiglu_reference(h1: torch.Tensor, h3: torch.Tensor, limit: float = 7.0,
                             alpha: float = 1.702) -> torch.Tensor:
    """The clamped SwiGLU in plain differentiable torch (the slow reference and the
    shared experts' path)."""
    g = h1.clamp(max=limit)
    return (h3.clamp(-limit, limit) + 1) * g * torch.sigmoid(g * alpha)
