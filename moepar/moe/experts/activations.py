"""Activations beyond the built-in gelu / relu / swiglu, for GroupedExperts and the shared experts.

Legend: N rows, F ffn hidden. ``h1 [N, F]`` is the gate pre-activation (x @ w1 + b1),
``h3 [N, F]`` the up pre-activation (x @ w3 + b3).

Clamped SwiGLU (GPT-OSS; limit 7.0, alpha 1.702 in its released config):
    g = clamp(h1, max=limit);  u = clamp(h3, -limit, limit)
    a = (u + 1) * g * sigmoid(alpha * g)
The clamps pass gradient where the input lies inside the closed bounds, as torch.clamp
does, so the hand-written backward equals autograd through ``clamped_swiglu_reference``.

Elementwise functions (``ELEMENTWISE``), each plain or gated: the same formulas as the
activations Hugging Face models name (``hidden_act``), so a converted model computes what
transformers computes. ``activation="<fn>"`` applies ``fn(h1)``; ``"glu_<fn>"`` the gated
``fn(h1) * h3`` (GLU variants: "glu_gelu" is GEGLU, "glu_relu" ReGLU; silu's is "swiglu").
Their backward differentiates ``fn`` with autograd at the saved pre-activation (one
elementwise recompute); gelu, relu and swiglu keep their own hand-written paths.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ... import checks


def _tanh_gelu(x):   # transformers' gelu_new / gelu_accurate: the tanh formula with pow
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _fast_gelu(x):   # transformers' gelu_fast
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _laplace(x, mu=0.707107, sigma=0.282095):   # transformers' laplace
    return 0.5 * (1.0 + torch.erf((x - mu).div(sigma * math.sqrt(2.0))))


# name -> elementwise function; each the formula of the transformers activation of that role
ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,                                           # exact (erf)
    "relu": F.relu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),     # gelu_pytorch_tanh
    "gelu_new": _tanh_gelu,
    "gelu_fast": _fast_gelu,
    "gelu_clip10": lambda x: torch.clip(F.gelu(x), -10, 10),  # gelu_10
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu2": lambda x: torch.square(F.relu(x)),
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,                               # slope 0.01, nn.LeakyReLU's default
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "mish": F.mish,
    "identity": lambda x: x,
    "laplace": _laplace,
    "sqrt_softplus": lambda x: F.softplus(x).sqrt(),
}
# The activation names these add: plain gelu and relu, and gated silu ("swiglu"), are the
# built-in ones with hand-written backward.
PLAIN_NAMES = tuple(n for n in ELEMENTWISE if n not in ("gelu", "relu"))
GATED_NAMES = tuple("glu_" + n for n in ELEMENTWISE if n != "silu")


@dataclasses.dataclass(frozen=True)
class Elementwise:
    """``fn(h1)`` or, ``gated``, ``fn(h1) * h3``, with ``forward``/``backward`` on [N, F] blocks."""

    name: str
    gated: bool

    @staticmethod
    def of(activation: str) -> Optional["Elementwise"]:
        """The Elementwise for an activation name of this module, else None."""
        if activation in GATED_NAMES:
            return Elementwise(activation[4:], True)
        if activation in PLAIN_NAMES:
            return Elementwise(activation, False)
        return None

    def forward(self, h1: torch.Tensor, h3: Optional[torch.Tensor]) -> torch.Tensor:
        a = ELEMENTWISE[self.name](h1)
        return a * h3 if self.gated else a

    def backward(self, ga: torch.Tensor, h1: torch.Tensor, h3: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(d h1, d h3 or None) [N, F] from d a [N, F]: autograd through ``fn`` at h1."""
        with torch.enable_grad():
            x = h1.detach().requires_grad_()
            f = ELEMENTWISE[self.name](x)
            gf = ga * h3 if self.gated else ga
            (gh1,) = torch.autograd.grad(f, x, gf)
        return gh1, (f.detach() * ga if self.gated else None)


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """The clamped SwiGLU's constants; ``forward``/``backward`` work on [N, F] blocks."""

    limit: float = 7.0
    alpha: float = 1.702
    gated = True

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


# The experts' activations: built in ("clamped_swiglu": GPT-OSS) and this module's elementwise
# ones, plain ("gelu_tanh", ...) and gated ("glu_gelu", ...).
ACTIVATIONS = ("gelu", "swiglu", "relu", "clamped_swiglu") + PLAIN_NAMES + GATED_NAMES
GATED = ("swiglu", "clamped_swiglu") + GATED_NAMES   # activations with an up projection (w3/b3)
