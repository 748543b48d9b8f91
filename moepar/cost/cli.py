"""``python -m moepar report | recommend | price``: argparse front ends, and the model, hardware
and pipeline flags they share (how they become a ``MoESpec`` and a ``Hardware``).

Each ``*_main(argv)`` returns an exit code: 0 on success, 2 when the input is invalid
(the message, naming the valid values, goes to stderr). These commands never import torch
(a laptop without it can price a layout, and start-up stays quick); ``calibrate`` and
``validate``, which measure, are ``moepar.cost.cli_measure``'s and import the torch-using
modules inside their commands (tests/cost/test_cost_cli_imports.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable

from ..tables import fmt_bytes, fmt_time, format_table
from .architectures import MODEL_TYPES, MODELS, spec_fields_from_file
from .collectives import ALGOS, OPS, Hardware
from .presets import PRESETS
from .model import RECOMPUTE_MODULES, CostLayout, MoESpec
from .profiles import get_hardware
from .schedules import SCHEDULES, default_vp

MODEL_FIELDS = ("hidden", "ffn", "experts", "topk", "layers", "heads", "kv_heads", "vocab")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers") from None


def _guard(fn: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser, argv) -> int:
    args = parser.parse_args(argv)
    try:
        return fn(args)
    except (ValueError, OSError) as e:   # OSError: a file that cannot be read or written
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def check_output_path(path: str | None, flag: str) -> None:
    """Refuse, before any work, an output file whose folder does not exist."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: folder {folder!r} does not exist (create it first)")


def parse_size(text: str) -> int:
    """'64K', '64KiB', '1M', '65536' -> bytes (binary units)."""
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"size {text!r} is not a byte count >= 1 (e.g. 65536, 64K, 64M, 1GiB)")
    return int(value)


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
    g.add_argument("--dtype", default="bf16", help="activation and weight dtype: bf16 fp16 fp32, or an FP8 recipe: "
                                                  "fp8 (per-tensor or 1x128 blocks) or mxfp8 (Blackwell's 1x32 blocks)")
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
    g.add_argument("--redundant-experts", metavar="X", help="X extra expert slots per EP group (MoE(..., "
                   "redundant_experts=R)), planned from the loads above (uniform without); recommend: a "
                   "comma-separated list, each priced beside X=0")
    g.add_argument("--micro-batches", "--microbatches", dest="micro_batches", type=int, default=1,
                   help="micro-batches per step (gradient accumulation; with --pp the pipeline's M)")
    g.add_argument("--dedup", choices=("auto", "on", "off"), default="auto",
                   help="dispatch one row per token and EP rank (auto: as the layer, when the expected rows "
                        "are at most 0.3 of the routes under uniform routing)")
    g.add_argument("--dispatch-dtype", help="dtype of the dispatched rows (default: fp8 with --dtype fp8, else --dtype)")
    g.add_argument("--combine-dtype", help="dtype of the combined rows (default: bf16 with --dtype fp8, else --dtype)")
    g.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="activation recomputation, as Megatron's --recompute-granularity (default none)")
    g.add_argument("--recompute-modules", help=f"with --recompute selective: the modules recomputed, comma-separated "
                                               f"({', '.join(RECOMPUTE_MODULES)}; Megatron's default core_attn)")
    g.add_argument("--max-nodes-per-token", type=int, metavar="M",
                   help="node-limited routing: each token's experts lie on at most M nodes, sent over the network "
                        "once per node and forwarded over NVLink (DeepSeek-V3: 4)")
    g.add_argument("--mtp", action="store_true", help="train the model's multi-token-prediction modules too "
                                                      "(DeepSeek-V3's one; their compute and memory on the last stage)")
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
                   help="fraction of the dense peak a large GEMM reaches (default: the GPU generation's measured "
                        "figure for the dtype, docs/cost.md; 1.0 on a calibrated profile, whose rate is measured)")
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
    g.add_argument("--a2a-overlap", action="store_true",
                   help="hide each MoE layer's all-to-alls behind another micro-batch's compute (Megatron's "
                        "--overlap-moe-expert-parallel-comm, DualPipe's overlapped chunks)")


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
        from .replication import zipf_loads
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
    modules = tuple(m.strip() for m in a.recompute_modules.split(",") if m.strip()) if a.recompute_modules else ()
    return MoESpec(recompute=a.recompute, recompute_modules=modules, max_nodes_per_token=a.max_nodes_per_token,
                   train_mtp=a.mtp, tokens=a.tokens, dtype=a.dtype, capacity_factor=a.capacity_factor,
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


# ---- report ---------------------------------------------------------------------------

def _report(a: argparse.Namespace) -> int:
    from .pipeline import step_cost
    from .report import build_report, plot_png, render_markdown, render_text, to_json
    for path, flag in ((a.markdown, "--markdown"), (a.json, "--json"), (a.png, "--png")):
        check_output_path(path, flag)
    hw = hardware_from_args(a)
    # the default 1f1b runs one stage per rank (vp 1): the schedules are asked for the others
    vp = a.vp if a.vp is not None else default_vp(a.schedule)
    layout = CostLayout(a.gpus, hw.gpus_per_node, a.tp, a.ep, a.etp, a.sp, a.zero, a.pp, vp, a.schedule, a.a2a_overlap)
    spec = spec_from_args(a, layout.ep)
    for w in layout.warnings():
        print(f"warning: {w}", file=sys.stderr)
    if len(redundant_list(a)) > 1:
        raise ValueError(f"--redundant-experts {a.redundant_experts!r}: report prices one R (recommend takes a list)")
    cost = step_cost(spec, layout, hw, a.compute_efficiency, a.a2a, a.allreduce)
    base = (step_cost(spec.replace(redundant_experts=0), layout, hw, a.compute_efficiency, a.a2a, a.allreduce)
            if spec.redundant_experts else None)
    rep = build_report(cost, _int_list(a.compare_sizes) if a.compare_sizes else None, a.allreduce, base)
    print(render_text(rep))
    for path, text in ((a.markdown, render_markdown), (a.json, to_json)):
        if path:
            with open(path, "w") as f:
                f.write(text(rep))
            print(f"wrote {path}")
    if a.png:
        plot_png(rep, a.png)
        print(f"wrote {a.png}")
    return 0


def report_main(argv: list[str]) -> int:
    """Communication, FLOPs and memory report for one model on one layout."""
    p = argparse.ArgumentParser(prog="python -m moepar report", description=report_main.__doc__)
    add_model_args(p)
    add_hw_args(p)
    g = p.add_argument_group("layout")
    g.add_argument("--gpus", type=int, default=8)
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size (dense layers)")
    g.add_argument("--ep", type=int, default=1, help="expert parallel size")
    g.add_argument("--etp", type=int, default=1, help="expert tensor parallel size")
    g.add_argument("--sp", action="store_true", help="sequence parallelism in the TP group")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    add_pipeline_args(g)
    o = p.add_argument_group("output")
    o.add_argument("--markdown", help="also write the report as Markdown here")
    o.add_argument("--json", help="also write the report's data as JSON here")
    o.add_argument("--png", help="also plot bytes/time per collective and EP vs TP here (matplotlib)")
    o.add_argument("--compare-sizes", help="group sizes of the EP-vs-TP table (default 2,4,... <= gpus)")
    return _guard(_report, p, argv)


# ---- recommend --------------------------------------------------------------------------

def _recommend(a: argparse.Namespace) -> int:
    from .search import recommend
    check_output_path(a.json, "--json")
    hw = hardware_from_args(a)
    spec = spec_from_args(a).replace(redundant_experts=0)
    redundant = redundant_list(a)
    zero = _int_list(a.zero)
    bad = [z for z in zero if z not in (0, 1, 2, 3)]
    if bad or not zero:
        raise ValueError(f"--zero {a.zero!r}: stages must be among 0, 1, 2, 3")
    if a.memory_gib is not None and not (0 < a.memory_gib < math.inf):
        raise ValueError(f"--memory-gib {a.memory_gib} must be a finite number > 0")
    if a.global_tokens is not None and a.global_tokens < 1:
        raise ValueError(f"--global-tokens {a.global_tokens} must be >= 1")
    if a.top < 1:
        raise ValueError(f"--top {a.top} must be >= 1")
    mem = a.memory_gib * 2 ** 30 if a.memory_gib is not None else None
    from .search import find_layout, parse_find, pipeline_sizes
    vp = a.vp if a.vp is not None else default_vp(a.schedule)
    valid_pp = pipeline_sizes(spec, a.gpus, vp)
    pps = _int_list(a.pp) if a.pp else valid_pp
    bad = [p for p in pps if p not in valid_pp]
    if bad or not pps:
        raise ValueError(f"--pp {a.pp!r}: pipeline sizes must divide --gpus {a.gpus} with pp x vp <= "
                         f"layers={spec.layers} (vp={vp}); valid: {', '.join(map(str, valid_pp))}")
    find = parse_find(a.find) if a.find else None
    skipped: list = []
    cands = recommend(spec, a.gpus, hw, None, mem, a.global_tokens, a.compute_efficiency,
                      zero, a.cross_node_tp, a.a2a, a.allreduce, pps, a.schedule, vp, skipped, redundant,
                      a.a2a_overlap)
    if not cands:
        raise ValueError(f"no layout of {a.gpus} GPUs divides the model (experts={spec.experts}, "
                         f"hidden={spec.hidden}, tokens={spec.tokens})")
    fit = [c for c in cands if c.fits]
    rows, data = [], []
    for i, c in enumerate((fit or cands)[: a.top], 1):
        lay, cost = c.cost.layout, c.cost
        data.append({"rank": i, "pp": lay.pp, "schedule": lay.schedule if lay.pp > 1 else None, "vp": lay.vp,
                     "bubble_s": cost.bubble_time,
                     "tp": lay.tp, "sp": lay.sp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp,
                     "edp": lay.edp, "zero": lay.zero, "micro_batches": cost.spec.micro_batches,
                     "tokens": cost.spec.tokens, "memory_gib": cost.memory.total / 2 ** 30, "fits": c.fits,
                     "comm_s": cost.comm_per_step, "compute_s": cost.compute_per_step,
                     "step_s": cost.step_time_overlapped, "step_no_overlap_s": cost.step_time,
                     "mfu": cost.mfu(True), "mfu_no_overlap": cost.mfu(),
                     "tokens_per_s_per_gpu": cost.tokens_per_second_per_gpu(True),
                     "redundant_experts": cost.spec.redundant_experts, "imbalance": cost.routes.max / cost.routes.mean})
        rows.append({"#": i, "pp": lay.pp, "tp": lay.tp, "sp": "on" if lay.sp else "off", "ep": lay.ep, "etp": lay.etp,
                     "dp": lay.dp, "edp": lay.edp, "zero": lay.zero,
                     "micro-batches": f"{cost.spec.micro_batches} x {cost.spec.tokens}",
                     "memory": fmt_bytes(cost.memory.total), "comm": fmt_time(cost.comm_per_step),
                     "compute": fmt_time(cost.compute_per_step), "bubble": fmt_time(cost.bubble_time),
                     "no overlap": fmt_time(cost.step_time),
                     "MFU": f"{cost.mfu(True):.1%}", "tokens/s/GPU": f"{cost.tokens_per_second_per_gpu(True):.4g}",
                     "step": fmt_time(cost.step_time_overlapped)})
        if any(redundant) or spec.expert_loads is not None:   # after "zero": R and the max/mean it reaches
            rows[-1] = {**{k: rows[-1][k] for k in list(rows[-1])[:9]}, "X": cost.spec.redundant_experts,
                        "max/mean": f"{cost.routes.max / cost.routes.mean:.3g}",
                        **{k: rows[-1][k] for k in list(rows[-1])[9:]}}
    mem_text = fmt_bytes(mem or hw.memory_bytes)
    total = fit[0].cost.tokens_per_step if fit else cands[0].cost.tokens_per_step
    print(f"{len(cands)} layouts of {a.gpus} GPUs on {hw.name}; {len(fit)} fit in {mem_text} per GPU; "
          f"about {total} tokens per step; ranked by predicted step time with ideal overlap (step; "
          f"'no overlap' is the upper bound), large GEMMs at {cands[0].cost.compute_efficiency:.0%} of the "
          f"{'FP8' if spec.fp8 and hw.fp8_flops else 'BF16'} peak:")
    if skipped:
        print(f"({len(skipped)} pipelined layouts left out: their micro-batches break the {a.schedule!r} schedule's "
              f"rule at this global batch)")
    if not fit:
        print("NONE FITS: the smallest by memory are listed; add GPUs, raise --zero or lower --tokens")
    print(format_table(rows))
    if find is not None:
        print()
        print(find_layout(cands, find, a.find, skipped))
    if any(redundant):
        from .replication_report import verdict
        print()
        print(verdict(cands, hw, a.compute_efficiency, a.a2a, a.allreduce))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


def recommend_main(argv: list[str]) -> int:
    """Rank the layouts of a GPU count that fit in memory by predicted step time."""
    p = argparse.ArgumentParser(prog="python -m moepar recommend", description=recommend_main.__doc__)
    add_model_args(p)
    add_hw_args(p)
    g = p.add_argument_group("search")
    g.add_argument("--gpus", type=int, required=True)
    g.add_argument("--memory-gib", type=float, help="memory per GPU (default: the hardware's)")
    g.add_argument("--global-tokens", type=int,
                   help="tokens per step (default 1048576, or tokens x micro-batches x gpus if larger)")
    g.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider (default 0,1,2,3)")
    g.add_argument("--cross-node-tp", action="store_true", help="also consider tp/etp > gpus per node")
    g.add_argument("--top", type=int, default=10)
    add_pipeline_args(g, search=True)
    g.add_argument("--find", metavar="FIELDS", help="also print where the best layout with these sizes ranks "
                                                    "and how its step differs from the first, e.g. "
                                                    "'pp=16,ep=64,zero=1' (fields: pp tp ep etp zero sp)")
    g.add_argument("--json", help="write the ranked rows as JSON here")
    return _guard(_recommend, p, argv)


# ---- price: one collective, nccl-tests style ---------------------------------------------

def _price(a: argparse.Namespace) -> int:
    from .collectives import Placement, bus_factor
    check_output_path(a.json, "--json")
    hw = hardware_from_args(a)
    _positive_arg("--gpus", a.gpus)
    size = parse_size(a.size)
    gpn = hw.gpus_per_node
    if a.op == "p2p" and a.gpus != 2:
        raise ValueError(f"--gpus {a.gpus}: p2p is a transfer between 2 GPUs (--gpus 2)")
    if a.gpus > gpn and a.gpus % gpn:
        raise ValueError(f"--gpus {a.gpus} is not a whole number of nodes of --gpus-per-node {gpn}")
    pl = Placement.contiguous(a.gpus, gpn)
    t = hw.collective_time(a.op, pl, size, a.algo)
    algo = hw.resolve_algo(a.op, pl, size, a.algo)
    algbw = size / t if t > 0 else math.inf
    busbw = algbw * bus_factor(a.op, a.gpus)
    out = {"op": a.op, "algo": algo, "size_bytes": size, "gpus": a.gpus, "gpus_per_node": gpn,
           "nodes": pl.nodes, "nics_per_node": hw.nics, "hardware": hw.name, "time_s": t,
           "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9}
    print(f"{a.op} ({algo}) of {fmt_bytes(size)} over {a.gpus} GPUs ({pl.nodes} node(s) x {pl.per_node}, "
          f"{hw.nics} NICs per node) on {hw.name}:")
    print(f"{'size (B)':>14} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    print(f"{size:>14} {t * 1e6:>12.2f} {algbw / 1e9:>13.2f} {busbw / 1e9:>13.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"wrote {a.json}")
    return 0


def price_main(argv: list[str]) -> int:
    """Predicted time, algbw and busbw of one collective, in nccl-tests' conventions (size:
    bytes per rank; busbw = algbw x 2(n-1)/n for all_reduce, (n-1)/n otherwise)."""
    p = argparse.ArgumentParser(prog="python -m moepar price", description=price_main.__doc__)
    p.add_argument("op", choices=(*OPS, "p2p"), help="a collective, or p2p: one tensor from one GPU to another "
                                                      "(a pipeline stage boundary; --gpus 2, --gpus-per-node 1 to "
                                                      "cross nodes)")
    p.add_argument("--size", default="1GiB", help="bytes per rank, nccl-tests' size (default 1GiB)")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--algo", help="algorithm (default: all_reduce auto, all_to_all pairwise, else ring)")
    p.add_argument("--json", help="write time_s, algbw_GBps, busbw_GBps (and the inputs) here")
    g = p.add_argument_group("hardware")
    g.add_argument("--hardware", default="h100",
                   help=f"preset ({', '.join(sorted(PRESETS))}) or a calibrated JSON profile (default h100)")
    g.add_argument("--gpus-per-node", type=int, help="default: the hardware's")
    g.add_argument("--nics-per-node", type=int, help="default: the hardware's NICs per GPU x --gpus-per-node")
    return _guard(_price, p, argv)
