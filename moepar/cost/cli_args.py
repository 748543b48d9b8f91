"""Shared argument groups of ``python -m moepar report | recommend`` (``moepar.cost.cli``):
the model, hardware and pipeline flags and how they become a ``MoESpec`` and a ``Hardware``.
Torch-free, as the commands that use them."""
from __future__ import annotations

import argparse
import math
import os

from .accounting import DEFAULT_COMPUTE_EFFICIENCY
from .architectures import MODEL_TYPES, spec_fields_from_file
from .collectives import ALGOS
from .hardware import PRESETS, Hardware, get_hardware
from .model import MODELS, MoESpec
from .replication import zipf_loads
from .schedules import SCHEDULES

MODEL_FIELDS = ("hidden", "ffn", "experts", "topk", "layers", "heads", "kv_heads", "vocab")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers") from None


# ---- model / layout / hardware arguments -----------------------------------------------

def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(MODELS), help="a public configuration (explicit flags override it)")
    g.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (model types: "
                                                       f"{', '.join(MODEL_TYPES)}); explicit flags override it")
    g.add_argument("--hidden", type=int, help="D, model width")
    g.add_argument("--ffn", type=int, help="F, expert hidden width")
    g.add_argument("--experts", type=int, help="E, experts per layer")
    g.add_argument("--topk", type=int, help="K, experts per token")
    g.add_argument("--tokens", type=int, default=8192, help="T, tokens per micro-batch per TP group (default 8192)")
    g.add_argument("--dtype", default="bf16", help="activation and weight dtype: bf16 fp16 fp32 fp8")
    g.add_argument("--capacity-factor", type=float, help="capacity mode (default: dropless)")
    g.add_argument("--min-capacity", type=int, default=4)
    g.add_argument("--pad-to-capacity", action="store_true", help="send E·C rows whatever the routing")
    g.add_argument("--shared-experts", type=int, help="default 0, or the --model's / --hf-config's")
    g.add_argument("--shared-ffn", type=int, help="shared experts' ffn (default --ffn)")
    g.add_argument("--plain-mlp", action="store_true", help="2-matrix experts instead of SwiGLU's 3")
    g.add_argument("--layers", type=int, help="transformer blocks (default 1, or the --model's)")
    g.add_argument("--heads", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--vocab", type=int, help="vocabulary (embeddings and output layer)")
    g.add_argument("--seq-len", type=int, help="adds attention-score FLOPs")
    g.add_argument("--imbalance", type=float, default=1.0, help="max/mean routes per EP rank (>= 1)")
    g.add_argument("--routing-counts", help="measured tokens per expert, comma-separated or a file: the "
                                            "imbalance follows for each layout's ep (instead of --imbalance)")
    g.add_argument("--zipf", type=float, metavar="S", help="Zipf-like loads instead: expert i gets 1/(i+1)^S "
                                                           "(expert 0 the hottest, docs/routing.md's table)")
    g.add_argument("--redundant-experts", metavar="R", help="R extra expert slots per EP group (MoE(..., "
                   "redundant_experts=R)), planned from the loads above (uniform without); recommend: a "
                   "comma-separated list, each priced beside R=0")
    g.add_argument("--micro-batches", "--microbatches", dest="micro_batches", type=int, default=1,
                   help="micro-batches per step (gradient accumulation; with --pp the pipeline's M)")
    g.add_argument("--dedup", choices=("auto", "on", "off"), default="auto",
                   help="dispatch one row per token and EP rank (auto: as the layer, when the expected rows "
                        "are at most 0.3 of the routes under uniform routing)")
    g.add_argument("--dispatch-dtype", help="dtype of the dispatched rows (default: fp8 with --dtype fp8, else --dtype)")
    g.add_argument("--combine-dtype", help="dtype of the combined rows (default: bf16 with --dtype fp8, else --dtype)")
    g.add_argument("--combine-grad-dtype", choices=["fp8"], default=None,
                   help="fp8: the combine's gradient, sent back to the experts' ranks, in FP8 too "
                        "(the layer's combine_grad_dtype; default: the combined rows' dtype)")


def add_hw_args(p: argparse.ArgumentParser, default: str = "h100") -> None:
    g = p.add_argument_group("hardware")
    g.add_argument("--hardware", default=default,
                   help=f"preset ({', '.join(sorted(PRESETS))}) or a calibrated JSON profile (default {default})")
    g.add_argument("--gpus-per-node", type=int, help="default: the hardware's")
    g.add_argument("--nics-per-node", type=int, help="default: the hardware's NICs per GPU x --gpus-per-node")
    g.add_argument("--compute-efficiency", type=float,
                   help=f"fraction of the peak FLOP rate reached (default {DEFAULT_COMPUTE_EFFICIENCY} on a preset: "
                        f"published MFU of Megatron-Core on H100 is up to 47%%; 1.0 on a calibrated profile, "
                        f"whose rate is measured)")
    g.add_argument("--a2a", choices=ALGOS["all_to_all"], default="pairwise", help="all-to-all algorithm")
    g.add_argument("--allreduce", choices=ALGOS["all_reduce"], default="auto",
                   help="all-reduce algorithm (default auto: the fastest of ring, tree, NVLS at each size, as NCCL)")


def add_pipeline_args(g, search: bool = False) -> None:
    if search:
        g.add_argument("--pp", help="pipeline sizes to consider, comma-separated (default: every divisor of "
                                    "--gpus with pp x vp <= layers)")
    else:
        g.add_argument("--pp", type=int, default=1, help="pipeline stages (consecutive ranks; default 1)")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="torch.distributed.pipelining schedule (default 1f1b): gpipe, 1f1b, interleaved "
                        "(Interleaved1F1B), zb (InterleavedZeroBubble), zbv (ZBVZeroBubble), dualpipev (DualPipeV)")
    g.add_argument("--vp", type=int, help="stages per rank (virtual pipeline; default 2 for interleaved, zb, "
                                          "zbv and dualpipev, else 1)")


def _positive_arg(name: str, v) -> None:
    if v is not None and v < 1:
        raise ValueError(f"{name}={v} must be >= 1")


def hardware_from_args(a: argparse.Namespace) -> Hardware:
    """--hardware with --gpus-per-node / --nics-per-node applied (validated, never defaulted
    silently: 0 is refused, not read as "unset")."""
    hw = get_hardware(a.hardware)
    _positive_arg("--gpus-per-node", a.gpus_per_node)
    _positive_arg("--nics-per-node", a.nics_per_node)
    if a.gpus_per_node is None and a.nics_per_node is None:
        return hw
    gpn = hw.gpus_per_node if a.gpus_per_node is None else a.gpus_per_node
    return hw.with_gpus_per_node(gpn, a.nics_per_node)


def spec_from_args(a: argparse.Namespace, ep: int = 1) -> MoESpec:
    if a.model and getattr(a, "hf_config", None):
        raise ValueError("pass --model or --hf-config, not both")
    base = dict(MODELS[a.model]) if a.model else {}
    if getattr(a, "hf_config", None):
        base = spec_fields_from_file(a.hf_config)
    for k in MODEL_FIELDS:
        if getattr(a, k) is not None:
            base[k] = getattr(a, k)
    missing = [f"--{k}" for k in ("hidden", "ffn", "experts", "topk") if k not in base]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or pass --hf-config, or --model, one of: "
                         f"{', '.join(sorted(MODELS))})")
    imbalance = a.imbalance
    if not (math.isfinite(imbalance) and imbalance >= 1):
        raise ValueError(f"--imbalance {imbalance} must be a finite number >= 1 (max/mean routes per EP rank)")
    loads = None
    if a.routing_counts and a.zipf is not None:
        raise ValueError("pass --routing-counts or --zipf, not both (each gives the per-expert loads)")
    if a.routing_counts:
        loads = _counts_from_file(a.routing_counts, base["experts"])
    elif a.zipf is not None:
        if not (math.isfinite(a.zipf) and a.zipf >= 0):
            raise ValueError(f"--zipf {a.zipf} must be a finite number >= 0 (the Zipf exponent of the loads)")
        loads = tuple(zipf_loads(base["experts"], a.zipf))
    redundant = redundant_list(a)
    if imbalance != 1 and (loads is not None or any(redundant)):
        what = "--routing-counts/--zipf" if loads is not None else f"--redundant-experts {a.redundant_experts}"
        raise ValueError(f"--imbalance {imbalance} cannot be combined with {what}: --imbalance is max/mean routes "
                         f"per EP rank and does not say which experts are hot; give per-expert loads "
                         f"(--routing-counts or --zipf) and the imbalance follows from them on each layout")
    for k, v in (("shared_experts", a.shared_experts), ("shared_ffn", a.shared_ffn)):
        if v is not None:
            base[k] = v
    if a.plain_mlp:
        base["gated"] = False
    return MoESpec(tokens=a.tokens, dtype=a.dtype, capacity_factor=a.capacity_factor,
                   min_capacity=a.min_capacity, pad_to_capacity=a.pad_to_capacity,
                   seq_len=a.seq_len, imbalance=imbalance, micro_batches=a.micro_batches,
                   dedup=getattr(a, "dedup", "auto"), dispatch_dtype=getattr(a, "dispatch_dtype", None),
                   combine_dtype=getattr(a, "combine_dtype", None),
                   combine_grad_dtype=getattr(a, "combine_grad_dtype", None), expert_loads=loads,
                   redundant_experts=redundant[-1] if len(redundant) == 1 else 0, **base)


def redundant_list(a: argparse.Namespace) -> list[int]:
    """--redundant-experts: one R >= 0 (report), or a comma-separated list (recommend)."""
    values = _int_list(a.redundant_experts) if a.redundant_experts else [0]
    if not values or any(v < 0 for v in values):
        raise ValueError(f"--redundant-experts {a.redundant_experts!r} must be integers >= 0")
    return values


def _counts_from_file(text: str, experts: int) -> tuple[float, ...]:
    """--routing-counts: comma-separated counts or a file of them, one per expert."""
    if "," not in text:
        if not os.path.isfile(text):
            raise ValueError(f"--routing-counts {text!r} is neither a comma-separated list nor an existing file")
        with open(text) as f:
            text = f.read().replace("\n", ",")
    try:
        counts = [float(x) for x in text.replace(" ", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError("--routing-counts: the counts must be numbers (tokens per expert)") from None
    if len(counts) != experts:
        raise ValueError(f"--routing-counts has {len(counts)} counts; the model has experts={experts} "
                         f"(one count per expert)")
    if not all(math.isfinite(c) and c >= 0 for c in counts) or not sum(counts) > 0:
        raise ValueError("--routing-counts: every count must be a finite number >= 0, and some > 0")
    return tuple(counts)
