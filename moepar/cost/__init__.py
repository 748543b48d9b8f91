"""Communication cost model: collectives, per-layer accounting, EP vs TP, reports.

``python -m moepar report|recommend|price|calibrate|validate`` are the command-line front ends
(``moepar.cost.cli``); the same pieces are importable:

    from moepar.cost import MoESpec, CostLayout, get_hardware, step_cost
    cost = step_cost(MoESpec(hidden=4096, ffn=14336, experts=8, topk=2, tokens=8192),
                     CostLayout(gpus=64, gpus_per_node=8, tp=2, ep=8), get_hardware("h100"))
"""
from .accounting import DEFAULT_COMPUTE_EFFICIENCY, Call, StepCost, layer_calls, step_calls, wire_bytes
from .collectives import Curve, Link, Placement, bus_factor, busbw, link_time, pick_algo
from .compare import crossover_topk, ep_vs_tp, recommend
from .hardware import PRESETS, Hardware, get_hardware, load_profile, save_profile
from .compute import count_flops, memory_per_rank
from .model import CostLayout, MoESpec, count_params, imbalance_from_counts, routes_per_rank
from .pipeline import stage_cost, step_cost
from .report import build_report, measured_vs_predicted, render_markdown, render_text
from .schedules import SCHEDULES, bubble_fraction

__all__ = [
    "DEFAULT_COMPUTE_EFFICIENCY", "pick_algo", "wire_bytes", "Call", "CostLayout", "Curve", "Hardware", "Link", "MoESpec", "PRESETS", "Placement", "StepCost",
    "build_report", "bus_factor", "busbw", "count_flops", "count_params", "crossover_topk", "ep_vs_tp",
    "get_hardware", "imbalance_from_counts", "layer_calls", "link_time", "load_profile",
    "measured_vs_predicted", "memory_per_rank", "recommend", "render_markdown", "render_text",
    "routes_per_rank", "save_profile", "step_calls", "step_cost", "stage_cost", "SCHEDULES", "bubble_fraction",
]
