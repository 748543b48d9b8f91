"""One rank's training step: compute, communication, the pipeline bubble and the optimizer,
and what of the communication the step can hide.

Two bounds. *No overlap* (``step_time``): communication + compute + bubble + optimizer step.
*Ideal overlap* (``step_time_overlapped``) hides, each at most what its window allows:

- the data-parallel gradient reduction behind the backward that produces it: the last
  micro-batch's backward for ZeRO 0/1 (gradients accumulate locally until then), every
  micro-batch's for ZeRO 2/3; the updated weights' all-gather (ZeRO 1/2) behind the next
  step's first forward; ZeRO-3's weight gathers behind the compute before them (prefetch);
- the MoE all-to-alls: with ``a2a_overlap`` (Megatron-Core's 1F1B all-to-all overlap,
  ``--overlap-moe-expert-parallel-comm``; DualPipe's overlapped forward-and-backward chunks),
  per MoE layer the all-to-alls of one micro-batch behind the other micro-batch's compute
  of that layer, min(all-to-alls, compute), for the micro-batches of the steady state
  (m - 1 without pipeline stages, m - (p - 1) with them: the warm-up and cool-down
  micro-batches run alone); without it, the forward dispatch behind the shared experts'
  forward (what the layer itself overlaps);
- the pipeline's stage-boundary transfers of the steady state (torch issues them
  asynchronously);

and all of them together at most the step's compute (communication hides only behind compute).

The bound: a collective hides only behind compute that does not wait for it, on links and
SMs of its own; the SMs a communication kernel takes from the GEMMs (DeepEP's, DualPipe's
20 of 132) are not priced.
"""
from __future__ import annotations

import dataclasses

from .accounting import BWD_SHARE, Call, Flops, calls_per_step, count_flops, layer_calls, step_calls
from .collectives import Hardware
from .compute import ComputeTime, gemm_dtype, gemm_efficiency, microbatch_compute, optimizer_seconds
from .memory import Memory, memory_per_rank
from .model import CostLayout, MoESpec, Params, check_fits, count_params, wire_bytes
from .routes import Routes, routes_per_rank

MOE_A2A = ("MoE dispatch", "MoE combine", "MoE dispatch grad", "MoE combine grad", "MoE dedup side",
           "MoE dedup side grad")


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The full prediction for one training step on one (the most loaded) rank."""

    spec: MoESpec
    layout: CostLayout
    hardware: Hardware
    params: Params
    routes: Routes
    flops: Flops
    memory: Memory
    layer: list[Call]
    step: list[Call]
    compute_efficiency: float    # the large-GEMM efficiency of the model's GEMM dtype (or the given one)
    p2p: tuple[Call, ...] = ()   # pipeline sends/receives per micro-batch (moepar.cost.pipeline)
    bubble_units: float = 0.0    # the schedule's bubble, in micro-batch times t_mb
    pipeline: object = None      # pipeline.PipelineInfo when pp > 1
    compute: ComputeTime | None = None   # per micro-batch by term; None: FLOPs at the measured rate
    optimizer_time: float = 0.0  # the optimizer step, once per step

    @property
    def comm_per_layer(self) -> float:
        return sum(c.total_seconds for c in self.layer)

    @property
    def p2p_per_microbatch(self) -> float:
        """Seconds a micro-batch waits on its stage boundaries: the receives (each transfer
        once; its send is the peer's receive)."""
        return sum(c.total_seconds for c in self.p2p if c.op == "recv")

    @property
    def recompute_comm_per_microbatch(self) -> float:
        """The forward all-to-alls a full or MoE recomputation issues again in the backward."""
        s = self.spec
        if s.recompute != "full" and "moe" not in s.recomputed:
            return 0.0
        return sum(c.total_seconds for c in self.layer if c.name in MOE_A2A and c.phase == "fwd") * s.moe_layers

    def a2a_per_layer(self) -> float:
        """Seconds of one MoE layer's all-to-alls per micro-batch, forward and backward."""
        return sum(c.total_seconds for c in self.layer if c.name in MOE_A2A)

    @property
    def comm_per_step(self) -> float:
        return (sum(c.seconds * calls_per_step(c, self.spec) for c in self.layer + self.step)
                + (self.p2p_per_microbatch + self.recompute_comm_per_microbatch) * self.spec.micro_batches)

    @property
    def rate(self) -> float:
        """FLOP/s of the simple model (a calibrated profile): its rate x compute efficiency."""
        return self.hardware.flops * self.compute_efficiency

    @property
    def compute_per_microbatch(self) -> float:
        return self.compute.total if self.compute is not None else self.flops.rank_max / self.rate

    @property
    def backward_per_microbatch(self) -> float:
        return self.compute.backward if self.compute is not None else self.flops.rank_max * BWD_SHARE / self.rate

    @property
    def compute_per_step(self) -> float:
        return self.compute_per_microbatch * self.spec.micro_batches

    @property
    def microbatch_time(self) -> float:
        """t_mb: one micro-batch's forward + backward on this rank: compute, its layers'
        collectives and its stage boundaries (no overlap)."""
        mb = self.spec.micro_batches
        layers = sum(c.seconds * calls_per_step(c, self.spec) for c in self.layer)
        return (self.compute_per_step + layers) / mb + self.p2p_per_microbatch + self.recompute_comm_per_microbatch

    @property
    def bubble_time(self) -> float:
        """Seconds the pipeline's fill and drain leave this rank idle (0 without stages)."""
        return self.bubble_units * self.microbatch_time

    @property
    def hidden_p2p(self) -> float:
        """The steady state's stage-boundary transfers behind compute (torch issues them
        asynchronously); the fill and drain keep theirs (they are in ``bubble_time``)."""
        return self.p2p_per_microbatch * self.spec.micro_batches

    @property
    def step_time(self) -> float:
        """Communication + compute (+ the pipeline bubble and the optimizer step), no overlap
        assumed (an upper bound)."""
        return self.comm_per_step + self.compute_per_step + self.bubble_time + self.optimizer_time

    @property
    def grad_reduction(self) -> float:
        """Seconds of gradient reduction per step (the per-step calls named ``... grads``)."""
        return sum(c.total_seconds for c in self.step if "grads" in c.name)

    @property
    def weight_gathers(self) -> float:
        """Seconds of the ZeRO weight all-gathers per step (updated weights; ZeRO-3's gathers)."""
        return sum(c.total_seconds for c in self.step if "weights" in c.name)

    @property
    def hidden_grad_reduction(self) -> float:
        """Gradient reduction behind the backward: the last micro-batch's backward for ZeRO
        0/1 (gradients accumulate locally until then), every micro-batch's for ZeRO 2/3."""
        windows = self.spec.micro_batches if self.layout.zero >= 2 else 1
        return min(self.grad_reduction, self.backward_per_microbatch * windows)

    @property
    def hidden_weight_gathers(self) -> float:
        """ZeRO 1/2: the updated weights' all-gather behind the next step's first forward;
        ZeRO-3: the weight gathers behind the compute before them."""
        if self.compute is None:   # the simple model (a calibrated profile) keeps them exposed
            return 0.0
        window = (self.compute_per_step if self.layout.zero >= 3
                  else self.compute_per_microbatch - self.backward_per_microbatch)
        return min(self.weight_gathers, window)

    @property
    def overlapped_microbatches(self) -> int:
        """Micro-batches of the steady state, whose all-to-alls hide behind another's compute."""
        m, p = self.spec.micro_batches, self.layout.pp
        return max(0, m - 1) if p == 1 else max(0, m - (p - 1))

    @property
    def hidden_a2a(self) -> float:
        """With ``a2a_overlap``: per MoE layer and steady-state micro-batch, min(its all-to-alls,
        the paired micro-batch's compute of that layer)."""
        s = self.spec
        if not self.layout.a2a_overlap or not s.moe_layers or self.layout.ep == 1:
            return 0.0
        per_layer = self.compute_per_microbatch / s.layers
        return min(self.a2a_per_layer(), per_layer) * s.moe_layers * self.overlapped_microbatches

    @property
    def hidden_shared_experts(self) -> float:
        """Shared experts' forward compute behind the forward dispatch all-to-all (and the
        dedup side message), per step: what the layer overlaps; none under ``a2a_overlap``,
        which hides the all-to-alls behind more."""
        s = self.spec
        if not s.shared_experts or self.layout.ep == 1 or self.layout.a2a_overlap:
            return 0.0
        if self.compute is not None:
            shared_fwd = 2 * s.tokens * self.params.shared / self.layout.tp / (
                self.hardware.peak(gemm_dtype(s)) * self.compute_efficiency)
        else:
            shared_fwd = 2 * s.tokens * self.params.shared / self.layout.tp / self.rate
        a2a = sum(c.total_seconds for c in self.layer if c.name in ("MoE dispatch", "MoE dedup side"))
        return min(a2a, shared_fwd) * s.moe_layers * s.micro_batches

    @property
    def hidden_each(self) -> float:
        """The overlaps above, each within its own window (they may claim the same compute)."""
        return (self.hidden_grad_reduction + self.hidden_weight_gathers + self.hidden_shared_experts
                + self.hidden_a2a + self.hidden_p2p)

    @property
    def hidden(self) -> float:
        """What the overlaps hide together: at most the step's compute, behind which alone
        communication can hide."""
        return min(self.hidden_each, self.compute_per_step)

    @property
    def step_time_overlapped(self) -> float:
        """Ideal overlap: the step less what each overlap hides (module doc; a lower bound for
        these rates)."""
        return self.step_time - self.hidden

    @property
    def tokens_per_step(self) -> int:
        """Global batch: T tokens per micro-batch per TP group x dp groups x micro-batches."""
        return self.spec.tokens * self.layout.dp * self.spec.micro_batches

    def mfu(self, overlapped: bool = False) -> float:
        """Model FLOPs (6·N_active per token, + attention scores) per step over the BF16 peak
        of every GPU for the predicted step time."""
        t = self.step_time_overlapped if overlapped else self.step_time
        return self.flops.model * self.spec.micro_batches / (self.layout.gpus * self.hardware.flops * t)

    def tokens_per_second_per_gpu(self, overlapped: bool = False) -> float:
        t = self.step_time_overlapped if overlapped else self.step_time
        return self.tokens_per_step / t / self.layout.gpus

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hardware.memory_bytes

    def terms(self) -> dict[str, float]:
        """The ideal-overlap step as a sum of named seconds (what dominates a prediction)."""
        mb, out = self.spec.micro_batches, {}
        c = self.compute
        if c is not None:
            out.update({"dense GEMMs": c.dense_gemm * mb, "expert GEMMs": c.expert_gemm * mb,
                        "attention": c.attention * mb, "memory-bound passes": c.memory * mb,
                        "recomputation": c.recompute * mb})
        else:
            out["compute"] = self.compute_per_step
        a2a = (sum(x.seconds * calls_per_step(x, self.spec) for x in self.layer if x.name in MOE_A2A)
               + self.recompute_comm_per_microbatch * mb)
        other = sum(x.seconds * calls_per_step(x, self.spec) for x in self.layer + self.step
                    if x.name not in MOE_A2A and "grads" not in x.name and "weights" not in x.name)
        out["expert all-to-all (exposed)"] = a2a - self.hidden_a2a - self.hidden_shared_experts
        out["TP, ETP and other collectives"] = other
        out["data-parallel gradients and weights (exposed)"] = (self.grad_reduction + self.weight_gathers
                                                                - self.hidden_grad_reduction
                                                                - self.hidden_weight_gathers)
        out["pipeline bubble"] = self.bubble_time
        out["optimizer step"] = self.optimizer_time
        out["communication beyond the compute that hides it"] = self.hidden_each - self.hidden
        return out


def price_stage(spec: MoESpec, layout: CostLayout, hw: Hardware, compute_efficiency: float | None,
                a2a_algo: str = "pairwise", ar_algo: str = "auto") -> StepCost:
    """Everything of one rank whose layers are ``spec``'s (the whole model, or a pipeline
    stage's share of it), without stage boundaries. A hardware with a ``generation`` (every
    preset) prices compute term by term (``moepar.cost.compute``; ``compute_efficiency``
    replaces the generation's large-GEMM figure); one without (a calibrated profile) at its
    FLOP rate x ``compute_efficiency`` (default 1: the profile's rate is a measured one)."""
    check_fits(spec, layout)
    params = count_params(spec, layout)
    routes = routes_per_rank(spec, layout)
    flops = count_flops(spec, layout, params, routes)
    w = wire_bytes(spec)
    memory = memory_per_rank(spec, layout, params, routes, param_bytes=w.param)
    compute, opt = None, 0.0
    if hw.generation:
        compute = microbatch_compute(spec, layout, hw, params, routes, compute_efficiency)
        opt = optimizer_seconds(layout, hw, params, w.param, w.param)
        eff = compute_efficiency if compute_efficiency is not None else gemm_efficiency(hw, gemm_dtype(spec))
    else:
        eff = 1.0 if compute_efficiency is None else compute_efficiency
    return StepCost(spec, layout, hw, params, routes, flops, memory,
                    layer_calls(spec, layout, hw, routes, a2a_algo, ar_algo),
                    step_calls(spec, layout, hw, params, ar_algo), eff, compute=compute, optimizer_time=opt)
