"""Communication cost model: collectives, per-layer accounting, EP vs TP, reports.

``python -m moepar report|recommend|price|calibrate|validate`` are the command-line front ends
(``moepar.cost.cli``, ``moepar.cost.cli_measure``); the same pieces are importable:

    from moepar.cost import MoESpec, CostLayout, get_hardware, step_cost
    cost = step_cost(MoESpec(hidden=4096, ffn=14336, experts=8, topk=2, tokens=8192),
                     CostLayout(gpus=64, gpus_per_node=8, tp=2, ep=8), get_hardware("h100"))
"""
from .._lazy import attach as _attach

# public name -> the module defining it; each is imported on first use (``moepar._lazy``),
# so that a command runs and imports only the modules it needs
_NAMES = {
    **{name: ".accounting" for name in ("Call", "count_flops", "layer_calls", "step_calls")},
    "StepCost": ".step", "memory_per_rank": ".memory", "EFFICIENCY": ".compute",
    "PRESETS": ".presets",
    **{name: ".collectives" for name in ("Hardware", "Link", "Placement", "bus_factor", "busbw",
                                         "link_time", "pick_algo")},
    **{name: ".model" for name in ("CostLayout", "MoESpec", "count_params", "wire_bytes")},
    "imbalance_from_counts": ".routes", "routes_per_rank": ".routes",
    "stage_cost": ".pipeline", "step_cost": ".pipeline",
    **{name: ".profiles" for name in ("Curve", "get_hardware", "load_profile", "save_profile")},
    **{name: ".report" for name in ("build_report", "crossover_topk", "ep_vs_tp", "render_markdown", "render_text")},
    "measured_vs_predicted": ".run_report",
    "SCHEDULES": ".schedules", "bubble_fraction": ".schedules",
    "recommend": ".search",
}

__all__ = [
    "EFFICIENCY", "pick_algo", "wire_bytes", "Call", "CostLayout", "Curve", "Hardware", "Link", "MoESpec", "PRESETS", "Placement", "StepCost",
    "build_report", "bus_factor", "busbw", "count_flops", "count_params", "crossover_topk", "ep_vs_tp",
    "get_hardware", "imbalance_from_counts", "layer_calls", "link_time", "load_profile",
    "measured_vs_predicted", "memory_per_rank", "recommend", "render_markdown", "render_text",
    "routes_per_rank", "save_profile", "step_calls", "step_cost", "stage_cost", "SCHEDULES", "bubble_fraction",
]
__getattr__, __dir__ = _attach(__name__, _NAMES)
