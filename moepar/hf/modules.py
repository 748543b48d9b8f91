"""A moepar ``MoE``'s tensors held under transformers' names and layouts.

``adopt(moe, family)`` turns the modules of a moepar ``MoE`` into the submodules of the
transformers block it replaces, in place, keeping their values:

  experts   ``HFExperts`` (a ``GroupedExperts``): ``gate_up_proj`` / ``down_proj`` (+ GPT-OSS's
            biases) in the family's layout (``moepar.hf.families``), this rank's shard: its
            experts ``[L, ...]``, its ffn columns under expert TP (gate columns, then up
            columns); Switch: ``expert_{g}.wi.weight`` / ``.wo.weight`` by global expert g.
  router    the ``TopKRouter`` itself (``weight``, ``bias``: transformers' names already),
            in transformers' dtype; with a selection bias an ``HFRouter`` whose buffer is
            ``e_score_correction_bias`` (its load count is no buffer: not in ``named_buffers``).
  shared    ``HFSharedExperts``: ``gate_proj`` / ``up_proj`` / ``down_proj`` (this TP rank's
            rows / columns); Qwen2-MoE's gate goes to the block as ``shared_expert_gate``.

The moepar names stay as read-only views (``experts.w1`` ..., ``router.expert_bias``,
``shared.w1`` ...), so that the layer's code and moepar's tools read them unchanged.
``GroupedExperts.weights()`` is the one place the GEMMs read the expert weights: here it
returns views of the HF tensors (transposes and slices, no copy; GPT-OSS's fused interleaved
gate / up as it is, with an activation that reads gate and up from alternate columns;
Switch's per-expert tensors stacked, a copy), and autograd carries the gradients back to the
HF tensors, written by the GEMMs straight into transformers' layouts (``weight_grad_buffers``;
``moepar.hf.views``).

Every expert tensor keeps moepar's markers (``moepar_expert``, ``moepar_expert_partition_dim``
of its own layout), also when transformers' loader replaces the Parameter object
(``setattr``): ``register_parameter`` puts them back.

Legend (docs/moe.md): L local experts, D hidden, Fl = F/etp the slice of the expert ffn hidden
F one expert-TP rank holds (this rank's ffn columns).
"""
from __future__ import annotations

import torch
from torch import nn

from moepar.moe import cpu
from moepar.moe.experts.activations import GATED
from moepar.moe.experts.grouped import GroupedExperts
from moepar.moe.layer import MoE
from moepar.moe.layer_options import SharedExperts
from moepar.parallel.fsdp import copy_local
from moepar.moe.routing.router import TopKRouter

from . import families, views

CANONICAL = ("w1", "w2", "w3", "b1", "b2", "b3")   # the order of GroupedExperts.weights()
# the dim each canonical tensor is sliced along by expert TP (GroupedExperts' markers)
CANONICAL_PDIM = {"w1": 2, "w3": 2, "w2": 1, "b1": 1, "b3": 1, "b2": None}
# the dim each HF expert tensor is sliced along by expert TP, per layout. The fused gate/up
# of "fused_chunk" / "chunk_in_out" holds this rank's gate columns then its up columns: not
# one block of the full tensor when etp > 1 (see docs/hf.md, moepar.checkpoint).
HF_PDIM = {"fused_chunk": {"gate_up_proj": 1, "down_proj": 2},
           "chunk_in_out": {"gate_up_proj": 2, "down_proj": 1},
           "interleaved": {"gate_up_proj": 2, "down_proj": 1, "gate_up_proj_bias": 1, "down_proj_bias": None},
           "per_expert": {"wi.weight": 0, "wo.weight": 1}}


class _Marked(nn.Module):
    """A module whose parameters get moepar's markers back whenever one is (re)registered."""

    def _marks(self, name: str) -> dict:
        return {}

    def register_parameter(self, name, param) -> None:
        super().register_parameter(name, param)
        if param is not None:
            for k, v in self._marks(name).items():
                setattr(param, k, v)


class _ExpertWeight(_Marked):
    """One Switch expert's ``wi`` / ``wo``: ``weight`` only (transformers' nn.Linear without bias)."""

    def __init__(self, weight: torch.Tensor, pdim: int, requires_grad: bool = True):
        super().__init__()
        self.pdim = pdim
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)

    def _marks(self, name):
        return {"moepar_expert": True, "moepar_expert_partition_dim": self.pdim}


class HFExperts(GroupedExperts, _Marked):
    """``GroupedExperts`` holding its tensors as transformers' experts module does
    (module docstring). Made from a built ``GroupedExperts`` by ``adopt`` (its values kept)."""

    @classmethod
    def adopt(cls, ex: GroupedExperts, fam) -> "HFExperts":
        if isinstance(ex, HFExperts):
            return ex
        local = {}
        for n in CANONICAL:
            p = ex._parameters.pop(n, None)
            if p is not None:
                local[n] = p
        ex.__class__ = cls
        ex.hf_layout = fam.layout
        if fam.layout == "interleaved" and ex.activation in GATED:   # one GEMM for gate and up
            ex._act = views.InterleavedGLU(ex._act)
        ex._family = fam
        hf = ex._hf_from_canonical({n: p.detach() for n, p in local.items()})
        if fam.layout == "per_expert":   # each expert's tensor a row of one [L, ...] block: no stack (StackT)
            for sub in ("wi.weight", "wo.weight"):
                keys = [f"expert_{g}.{sub}" for g in ex._experts()]
                block = torch.stack([hf[k].detach() for k in keys])
                hf.update(zip(keys, block.unbind(0)))
        grad = local["w1"].requires_grad
        for key, t in hf.items():
            if fam.layout == "per_expert":
                g, sub = key.split(".", 1)   # expert_{g}, wi.weight
                holder = ex._modules.get(g)
                if holder is None:
                    holder = nn.Module()
                    ex.add_module(g, holder)
                holder.add_module(sub.split(".")[0], _ExpertWeight(t.detach().contiguous(), HF_PDIM["per_expert"][sub],
                                                                   grad))
            else:
                setattr(ex, key, nn.Parameter(t.detach().contiguous(), requires_grad=grad))
        return ex

    def _marks(self, name):
        pdims = HF_PDIM.get(self.__dict__.get("hf_layout"), {})
        if name not in pdims:
            return {}
        return {"moepar_expert": True, "moepar_expert_partition_dim": pdims[name]}

    # ---- the canonical (moepar) layout as views of the HF tensors --------------------------

    def _hf(self, key: str, grads: bool = False, full: bool = False):
        t = self.get_parameter(key)
        if grads:
            t = t.grad if t.grad is not None else torch.zeros_like(t)
        return unsharded(t) if full else t

    def _experts(self) -> list[int]:
        return [self.first_expert + e for e in range(self.num_local_experts)]

    def canonical(self, names=CANONICAL, grads: bool = False, full: bool = False) -> dict[str, torch.Tensor]:
        """This rank's w1 [L, D, Fl], w3, w2 [L, Fl, D], b1/b3 [L, Fl], b2 [L, D] (those the
        experts have) as views of the HF tensors (Switch: stacked copies); ``grads``: of
        their gradients (zeros where there is none). ``full``: of the tensors FSDP2 sharded,
        all-gathered first (``unsharded``; a collective over each tensor's FSDP2 group)."""
        lay, out = self.hf_layout, {}
        gated = self.activation in GATED
        if lay == "per_expert":
            for n, sub in (("w1", "wi"), ("w2", "wo")):
                if n in names:
                    out[n] = torch.stack([self._hf(f"expert_{g}.{sub}.weight", grads, full).t()
                                          for g in self._experts()])
            return out
        gu, down = self._hf("gate_up_proj", grads, full), self._hf("down_proj", grads, full)
        out = {"w2": down.transpose(1, 2) if lay == "fused_chunk" else down}
        if "w1" in names or "w3" in names:
            out["w1"], out["w3"] = views.split_gate_up(gu, lay, 2)
        if lay == "interleaved":                      # + biases [L, 2Fl], [L, D]
            out["b1"], out["b3"] = views.split_gate_up(self._hf("gate_up_proj_bias", grads, full), lay, 1)
            out["b2"] = self._hf("down_proj_bias", grads, full)
        if not gated:
            out.pop("w3", None)
        return {n: t for n, t in out.items() if n in names}

    def weights(self) -> tuple:
        """The tensors the GEMMs read (``moepar.hf.views``): moepar's layout as views of the HF
        tensors; GPT-OSS's fused interleaved gate / up as it is, in the place of w1 / b1 (its
        activation takes gate and up from the GEMM's even and odd columns); Switch's
        per-expert tensors stacked (a copy, differentiable)."""
        lay = self.hf_layout
        if lay == "interleaved":   # the fused tensors as they are: w1, b1 of InterleavedGLU (adopt)
            return (self._hf("gate_up_proj"), self._hf("down_proj"), None, self._hf("gate_up_proj_bias"),
                    self._hf("down_proj_bias"), None)
        if lay == "per_expert":
            c = {n: views.StackT.apply(*[self._hf(f"expert_{g}.{sub}.weight") for g in self._experts()])
                 for n, sub in (("w1", "wi"), ("w2", "wo"))}
        else:
            c = self.canonical()
        return tuple(None if n not in c else views.gemm_ready(c[n]) for n in CANONICAL)

    def _check_input(self, x_ND: torch.Tensor) -> None:
        # GroupedExperts' checks read ``self.w1``, here a view built per read (Switch: a stack of
        # every expert's weight, a copy): the dtype and device are read from an HF tensor.
        w = next(self.parameters())
        if isinstance(x_ND, torch.Tensor) and x_ND.dim() == 2 and x_ND.shape[1] == self.hidden:
            if x_ND.dtype != w.dtype:
                raise ValueError(f"x_ND dtype {x_ND.dtype} != expert weight dtype {w.dtype}; "
                                 f"cast one of them (no implicit upcast of the activations)")
            if x_ND.device != w.device:
                raise ValueError(f"x_ND is on {x_ND.device} but the expert weights are on {w.device}")
        else:
            super()._check_input(x_ND)   # its shape errors

    def weight_grad_buffers(self) -> dict[str, torch.Tensor]:
        """Fresh gradients (pooled) of the expert tensors in transformers' layouts, as the
        views of moepar's layout that ``ExpertsFunction``'s backward writes into
        (``GroupedExperts.weight_grad_buffers``); autograd then hands each HF tensor its
        gradient without a copy (``moepar.hf.views``). GPT-OSS's interleaved gate / up: none
        (the GEMMs' fused gradient is transformers' layout already)."""
        lay, L = self.hf_layout, self.num_local_experts

        def fresh(key):
            p = self._hf(key)
            return cpu.empty(p.shape, p.dtype, p.device)
        if lay == "per_expert":   # [L, Fl, D] / [L, D, Fl], read transposed: StackT's layout
            out = {}
            for n, sub in (("w1", "wi"), ("w2", "wo")):
                p = self._hf(f"expert_{self.first_expert}.{sub}.weight")
                out[n] = cpu.empty((L, *p.shape), p.dtype, p.device).transpose(1, 2)
            return out
        if lay == "interleaved":   # its fused gradient is the GEMMs' own (weights())
            return {}
        down = fresh("down_proj")
        out = {"w2": down.transpose(1, 2) if lay == "fused_chunk" else down}
        out["w1"], out["w3"] = views.split(fresh("gate_up_proj"), lay, 2)
        if self.activation not in GATED:
            out.pop("w3")
        return out

    def __getattr__(self, name: str):
        # moepar's names (w1 ... b3) read as views; only the asked one is built
        if name in CANONICAL and "hf_layout" in self.__dict__:
            return self.canonical((name,)).get(name)
        return super().__getattr__(name)

    def _hf_from_canonical(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF tensors (keys relative to the experts module) of this rank's canonical ones."""
        hf = {k[len("experts."):]: v for k, v in families.write_experts(self._family, local).items()}
        if self.hf_layout == "per_expert" and self.first_expert:   # keys by global expert index
            hf = {f"expert_{int(k.split('.')[0][7:]) + self.first_expert}.{k.split('.', 1)[1]}": v
                  for k, v in hf.items()}
        return hf

    @torch.no_grad()
    def write_canonical(self, local: dict[str, torch.Tensor], skip=None) -> None:
        """Set the HF tensors from this rank's canonical ones (``canonical``'s shapes, any
        device); a parameter FSDP2 sharded takes its shard. ``skip(param)``: leave it."""
        for key, t in self._hf_from_canonical(local).items():
            p = self.get_parameter(key)
            if skip is None or not skip(p):
                copy_local(p, t.to(p.dtype))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw every local expert from its global init (as ``GroupedExperts``: the same
        values whatever the layout), into the HF tensors."""
        if "hf_layout" not in self.__dict__:   # GroupedExperts.__init__ of a class made by hand
            return super().reset_parameters()
        lo, hi = self.etp_rank * self.ffn_local, (self.etp_rank + 1) * self.ffn_local
        local: dict[str, torch.Tensor] = {}
        for e in range(self.num_local_experts):
            full = self.global_expert_init(self.first_expert + e, self.hidden, self.ffn_hidden, self.activation,
                                           self.bias, self.init_seed, self.init_std)
            for name, t in full.items():
                t = t[:, lo:hi] if name in ("w1", "w3") else t[lo:hi] if name in ("w2", "b1", "b3") else t
                if name not in local:
                    local[name] = torch.empty((self.num_local_experts,) + tuple(t.shape))
                local[name][e] = t
        self.write_canonical(local)


class HFRouter(TopKRouter):
    """``TopKRouter`` whose selection bias is the buffer transformers names (DeepSeek-V3's
    ``e_score_correction_bias``); ``expert_bias`` reads it. The load count of
    ``update_expert_bias`` is kept as a plain attribute, so that ``named_buffers()`` is
    transformers'; it follows the bias's device (zeros when it was left on meta)."""

    @classmethod
    def adopt(cls, router: TopKRouter, bias_name: str) -> "HFRouter":
        if isinstance(router, HFRouter):
            return router
        bias = router._buffers.pop("expert_bias")
        accum = router._buffers.pop("load_accum")
        router.__dict__.pop("expert_bias", None)
        router.__class__ = cls
        router.__dict__["_bias_name"] = bias_name
        router.__dict__["_load_accum"] = accum
        router.register_buffer(bias_name, bias)
        return router

    @property
    def expert_bias(self):
        return self._buffers[self.__dict__["_bias_name"]]

    @expert_bias.setter
    def expert_bias(self, value: torch.Tensor) -> None:   # update_expert_bias's ``+=``
        self._buffers[self.__dict__["_bias_name"]] = value

    @property
    def load_accum(self) -> torch.Tensor:
        t, ref = self.__dict__["_load_accum"], self.expert_bias
        if t.device != ref.device:
            t = torch.zeros(t.shape, dtype=t.dtype, device=ref.device) if t.is_meta else t.to(ref.device)
            self.__dict__["_load_accum"] = t
        return t

    @load_accum.setter
    def load_accum(self, value: torch.Tensor) -> None:
        self.__dict__["_load_accum"] = value


_SHARED_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class HFSharedExperts(SharedExperts):
    """``SharedExperts`` with transformers' child names (``gate_proj``, ``up_proj``,
    ``down_proj``); Qwen2-MoE's gate is held by the block (``shared_expert_gate``)."""

    @classmethod
    def adopt(cls, shared: SharedExperts) -> "HFSharedExperts":
        if isinstance(shared, HFSharedExperts):
            return shared
        mods = shared._modules
        renamed = {_SHARED_NAMES.get(n, n): m for n, m in mods.items() if n != "gate"}
        gate = mods.get("gate")
        mods.clear()
        mods.update(renamed)
        shared.__class__ = cls
        shared.__dict__["_gate"] = gate
        return shared

    w1 = property(lambda self: self._modules.get("gate_proj"))
    w3 = property(lambda self: self._modules.get("up_proj"))
    w2 = property(lambda self: self._modules.get("down_proj"))
    gate = property(lambda self: self.__dict__["_gate"])


def unsharded(t: torch.Tensor) -> torch.Tensor:
    """``t`` as this rank holds it without FSDP2: a DTensor (a parameter or gradient that
    ``moepar.fully_shard`` sharded over its data-parallel group) all-gathered over its mesh (a
    collective: every rank of the mesh calls it, for the same tensors in the same order);
    any other tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return t if full is None else full()


def canonical_local(ex, grads: bool = False, full: bool = False) -> dict[str, torch.Tensor]:
    """This rank's expert tensors (or their gradients, zeros where none) in moepar's layout
    (w1 [L, D, Fl] ...), of a ``GroupedExperts`` or the HF-layout ``HFExperts``; ``full``:
    FSDP2's shards all-gathered first (``unsharded``, a collective)."""
    if isinstance(ex, HFExperts):
        return ex.canonical(grads=grads, full=full)
    out = {}
    for name in CANONICAL:
        p = getattr(ex, name, None)
        if p is not None:
            t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p
            out[name] = unsharded(t) if full else t
    return out


def _cast(module: nn.Module, name: str, dtype) -> None:
    """Parameter ``name`` of ``module`` in ``dtype`` (its markers kept)."""
    p = module._parameters.get(name)
    if p is None or dtype is None or p.dtype == dtype:
        return
    new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)
    module._parameters[name] = new


def adopt(moe: MoE, fam, hf_dtypes: dict | None = None) -> dict[str, nn.Module]:
    """The MoE's modules as transformers' block holds them: {path in the block: module}, in
    place (values kept). The MoE keeps them as plain attributes, no longer as its children,
    so that each tensor has one name in the block: transformers'. ``hf_dtypes``: HF key ->
    dtype (the router's weight and bias take theirs)."""
    hf_dtypes = hf_dtypes or {}
    router, experts, shared = moe.router, moe.experts, moe.shared
    if router.expert_bias is not None:
        if not fam.expert_bias_key:
            raise ValueError(f"{fam.model_type} has no selection bias, but the MoE's router has one")
        router = HFRouter.adopt(router, fam.expert_bias_key.rsplit(".", 1)[1])
    _cast(router, "weight", hf_dtypes.get(f"{fam.router}.weight"))
    _cast(router, "bias", hf_dtypes.get(f"{fam.router}.bias"))
    parts = {fam.router: router, "experts": HFExperts.adopt(experts, fam)}
    if shared is not None:
        if not fam.shared:
            raise ValueError(f"{fam.model_type} has no shared experts, but the MoE has")
        shared = HFSharedExperts.adopt(shared)
        parts[fam.shared] = shared
        if shared.gate is not None:
            parts[fam.shared_gate] = shared.gate
    for part in parts.values():   # initialised by moepar.hf.init.init_block, not the model's _init_weights
        for m in part.modules():
            m._moepar_hf_part = True
    moe._moepar_hf_part = True
    for name in ("router", "experts", "shared"):   # one name per tensor: the block's
        m = moe._modules.pop(name, None)
        if m is not None:
            moe.__dict__[name] = m
    moe.__dict__["router"], moe.__dict__["experts"], moe.__dict__["shared"] = router, parts["experts"], shared
    return parts
