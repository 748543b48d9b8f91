"""DeepSpeed's engine for a model with moepar layers (imports DeepSpeed: only
``moepar.deepspeed.initialize`` imports this module).

Where DeepSpeed's engine knows only its own MoE layer class:

- ``_configure_distributed_model`` sets ``has_moe_layers`` when it finds a
  ``deepspeed.moe.layer.MoE``; the ZeRO optimizers, the gradient reduction and the
  checkpoints read that flag to treat ``allreduce=False`` parameters as experts. Here it is
  also set for moepar's expert parameters.
- ``clip_fp32_gradients`` (ZeRO-0, fp32) averages each rank's local norm over the
  data-parallel ranks; with experts the ranks' norms differ, and the average is not the
  norm. Here it is moepar's global norm (``moepar.clip_grad_norm_``: each slice once).
- ``_save_moe_checkpoint`` writes the module once per tensor-parallel rank, from
  data-parallel rank 0, and on load every rank reads that file: a rank whose experts are
  not data-parallel rank 0's would load another rank's experts. Here each expert slice is
  also written by its expert-data-parallel rank 0 (``EXPERT_FILE``) and read back into the
  module state before DeepSpeed loads it (so that ZeRO's fp32 copies, when refreshed from
  the module, are right too). Those files exist for every TP rank only when tp divides ep:
  ``save_checkpoint`` refuses other layouts before anything is written.
"""
from __future__ import annotations

import os
import re

import deepspeed
import torch

from moepar.parallel.grads import clip_grad_norm_, is_expert_param

# Beside DeepSpeed's files in a checkpoint tag's folder: one file per expert slice, named by
# the EP size and rank it was saved at.
EXPERT_FILE = "moepar_experts_ep{}_rank{:02d}.pt"
EXPERT_FILE_SIZE = re.compile(r"moepar_experts_ep(\d+)_rank\d+\.pt")


class MoeparEngine(deepspeed.DeepSpeedEngine):
    """``deepspeed.DeepSpeedEngine`` with moepar's experts counted as DeepSpeed's MoE experts
    (built by ``moepar.deepspeed.initialize``, whose mpu is a ``DeepSpeedMPU``)."""

    _moepar_loading: str | None = None

    @property
    def parallel_state(self):
        """moepar's ``ParallelState`` this engine runs on."""
        return self.mpu.state

    def _configure_distributed_model(self, model):
        super()._configure_distributed_model(model)
        if any(is_expert_param(p) for p in model.parameters()):
            self.has_moe_layers = True
            self.num_experts = [m.num_experts for m in model.modules()
                                if hasattr(m, "num_experts") and any(is_expert_param(p) for p in m.parameters())
                                and not any(hasattr(c, "num_experts") for c in m.children())]

    def clip_fp32_gradients(self):
        self._global_grad_norm = clip_grad_norm_(self.module, self.gradient_clipping(), self.parallel_state)

    def save_checkpoint(self, save_dir, *args, **kwargs):
        state = self.parallel_state
        if self.has_moe_layers and state.ep_size % state.tp_size:
            # DeepSpeed writes each TP rank's module (and, without ZeRO, optimizer) file from the
            # ranks that are expert-data-parallel rank 0, the first ep ranks: with tp not dividing
            # ep some TP ranks' files would be missing, and the load would fail
            raise ValueError(f"engine.save_checkpoint at tp={state.tp_size}, ep={state.ep_size}: DeepSpeed writes "
                             f"the files of a moepar model's TP ranks only when tp divides ep; save the weights "
                             f"with moepar.checkpoint.save(path, engine.module) instead")
        return super().save_checkpoint(save_dir, *args, **kwargs)

    def _save_moe_checkpoint(self, save_dir, tag, client_state={}, exclude_frozen_parameters=False):
        super()._save_moe_checkpoint(save_dir, tag, client_state=client_state,
                                     exclude_frozen_parameters=exclude_frozen_parameters)
        save_experts(self, os.path.join(save_dir, str(tag)))

    def _load_checkpoint(self, load_dir, tag, *args, **kwargs):
        self._moepar_loading = os.path.join(load_dir, str(tag))
        try:
            return super()._load_checkpoint(load_dir, tag, *args, **kwargs)
        finally:
            self._moepar_loading = None

    def load_module_state_dict(self, checkpoint, *args, **kwargs):
        if self._moepar_loading is not None and self.has_moe_layers:
            load_experts(self, self._moepar_loading, checkpoint["module"])
        return super().load_module_state_dict(checkpoint, *args, **kwargs)


def expert_file(state) -> str:
    return EXPERT_FILE.format(state.ep_size, state.ep_rank)


def save_experts(engine: MoeparEngine, folder: str) -> None:
    """Each expert slice once: its expert-data-parallel rank 0 writes its expert parameters
    (by name) and the layout they belong to."""
    state = engine.parallel_state
    if state.edp_rank != 0:
        return
    tensors = {n: p.detach().clone() for n, p in engine.module.named_parameters() if is_expert_param(p)}
    engine.checkpoint_engine.save({"ep_size": state.ep_size, "ep_rank": state.ep_rank, "experts": tensors},
                                  os.path.join(folder, expert_file(state)))


def load_experts(engine: MoeparEngine, folder: str, module_state: dict) -> None:
    """Put this rank's expert slice from ``folder`` into ``module_state``, the module state
    DeepSpeed is about to load (one data-parallel rank's, whose experts may be another's)."""
    state = engine.parallel_state
    path = os.path.join(folder, expert_file(state))
    if not os.path.isfile(path):
        sizes = sorted({int(m.group(1)) for f in os.listdir(folder) if (m := EXPERT_FILE_SIZE.fullmatch(f))})
        if sizes:
            raise ValueError(f"{folder} was saved at ep_size={sizes[0]}, this engine runs ep_size={state.ep_size}: "
                             f"DeepSpeed's checkpoints load at the layout they were saved at (moepar.checkpoint's "
                             f"save and load of engine.module reshard the weights across layouts)")
        raise ValueError(f"{folder} has no {expert_file(state)}: it was not saved by moepar.deepspeed's engine, and "
                         f"DeepSpeed's own files hold only one data-parallel rank's experts")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    names = [n for n, p in engine.module.named_parameters() if is_expert_param(p)]
    missing = [n for n in names if n not in saved["experts"]]
    if missing:
        raise ValueError(f"{path} lacks expert parameter {missing[0]!r} of this model")
    module_state.update(saved["experts"])
