"""The random sweep's cases and its loop (``sweep``); tests/project/test_sweep.py runs a few
fixed ones in every run and, marked slow, the timed random sweep.

A case is a dict: ``layout`` (tp, ep, etp), ``form`` (the token exchange form the case
must take, ``MoEStats.exchange_form``), ``layer`` (MoE options), ``uneven`` (5, 0, 3, 7
tokens per replica, else 6 each), ``sp``, ``dtype``, ``hidden`` and ``expert_bias`` (the
router's [E] bias values, nonzero, or None). ``draw`` draws the form first, then only
options under which the layer must take it; ``form_that_runs`` states, from the built
``MoEConfig`` alone, which form the dispatcher will take (tests/project/test_sweep.py checks the
two agree on many draws; the sweep checks the form that actually ran).

Not drawn, since the reference would differ by design: capacity with sequence parallelism
(capacity is per TP rank's slice, as in Megatron-Core), ``aux_loss_scope="global"``, and a
``receive_capacity_factor`` that could cut (the single-process reference has one rank,
which the guard never cuts: only factors >= ep, which never cut, are drawn).
"""
from __future__ import annotations

import random
import sys
import time
import traceback

import torch

from moepar.moe.config import MoEConfig, make_config
from moepar.moe.experts.function import path_supported

from . import moe_ref
from ..moe.test_moe_distributed import compare_layouts
from .tolerances import tolerance

LAYOUTS = [(1, 2, 1), (1, 4, 1), (2, 2, 1), (2, 2, 2), (1, 2, 2), (2, 1, 1), (1, 1, 1)]
FORMS = ("regroup", "source_major", "dedup", "padded", "direct")


def _layouts_for(form: str) -> list[tuple[int, int, int]]:
    """Layouts where ``form`` can run: dedup and source-major rows need ep > 1 and no
    expert TP; a regroup needs more than one source block (ep * etp > 1)."""
    if form in ("dedup", "source_major"):
        return [lay for lay in LAYOUTS if lay[1] > 1 and lay[2] == 1]
    if form == "regroup":
        return [lay for lay in LAYOUTS if lay[1] * lay[2] > 1]
    return LAYOUTS


def draw(rng: random.Random) -> dict:
    """One random case that is valid and must take its ``form``."""
    form = rng.choice(FORMS)
    tp, ep, etp = rng.choice(_layouts_for(form))
    # source-major rows and a regroup need > 1 local expert; "direct" with ep*etp > 1 needs 1
    Es = [e for e in (4, 8, 16) if e % ep == 0]
    if form in ("source_major", "regroup"):
        Es = [e for e in Es if e // ep > 1]
    elif form == "direct" and ep * etp > 1:
        Es = [ep] if ep in Es and ep >= 4 else []
        if not Es:   # no one-local-expert case in this layout: fall back to an all-local one
            tp, ep, etp = rng.choice([(2, 1, 1), (1, 1, 1)])
            Es = [4, 8, 16]
    E = rng.choice(Es)
    k = rng.choice([2, 3, 4] if form == "dedup" else [1, 2, 3, 4])
    dtype = rng.choice(["float32", "float32", "float64", "bfloat16"])
    hidden = rng.choice([8, 24])
    grouped = ["grouped_mm"] if path_supported("grouped_mm", torch.device("cpu"), getattr(torch, dtype),
                                               hidden, moe_ref.F // etp)[0] else []
    score = rng.choice(["softmax", "softmax_after_topk", "sigmoid"]) if k > 1 else rng.choice(["softmax", "sigmoid"])
    layer = dict(k=k, num_experts=E, score_func=score, num_shared_experts=rng.choice([0, 1]),
                 activation=rng.choice(["gelu", "swiglu", "relu"]), bias=rng.choice([False, True]),
                 normalize_weights=rng.choice([None, True, False]), scaling_factor=rng.choice([1.0, 2.5]),
                 expert_bias=rng.choice([False, True]), recompute_experts=rng.choice([False, True]),
                 gemm_path=rng.choice(["auto", "loop", "bmm"] + grouped),
                 aux_loss=rng.choice([None, "switch"]), z_loss_coeff=rng.choice([0.0, 1e-3]))
    if E >= 8 and rng.random() < 0.3:   # k <= 4 <= topk_groups x E/num_groups
        layer.update(num_groups=4, topk_groups=2)
    # the options that select the form (padded ignores them: draw them freely there)
    layer.update({"dedup": dict(dedup="on"), "source_major": dict(dedup="off", cpu_source_major=True),
                  "regroup": dict(dedup="off", cpu_source_major=etp > 1 and rng.random() < 0.5),
                  "direct": dict(dedup="off", cpu_source_major=rng.choice([False, True]))}.get(
        form, dict(dedup=rng.choice(["off", "auto", "on"]), cpu_source_major=rng.choice([False, True]))))
    sp = form != "padded" and tp > 1 and rng.random() < 0.3
    if form == "padded" or (not sp and rng.random() < 0.4):   # capacity (padded: slots too)
        layer.update(capacity_factor=rng.choice([0.5, 1.0, 2.0]), min_capacity=rng.choice([0, 1, 2]),
                     pad_to_capacity=form == "padded", drop_policy=rng.choice(["probs", "position"]))
    if form != "padded" and rng.random() < 0.3:   # the receive guard, with a factor that never cuts
        layer.update(receive_capacity_factor=float(ep) * rng.choice([1.0, 1.5]))
    bias = None
    if layer["expert_bias"]:   # nonzero, large enough against scores ~1/E to change the selection
        bias = [round(rng.choice([-1, 1]) * rng.uniform(0.02, 0.3), 4) for _ in range(E)]
    # padded capacity mode: every rank of a block routes the same tokens (equal capacities)
    uneven = form != "padded" and rng.choice([False, True])
    return dict(layout=(tp, ep, etp), form=form, layer=layer, uneven=uneven, sp=sp,
                dtype=dtype, hidden=hidden, expert_bias=bias)


def build_config(case: dict) -> MoEConfig:
    """The case's MoEConfig as the distributed layer builds it (validated: ValueError if not)."""
    tp, ep, etp = case["layout"]
    kw = dict(case["layer"], ffn_hidden=moe_ref.F, init_seed=77, dtype=getattr(torch, case["dtype"]),
              expert_tensor_parallel_size=etp, sequence_parallel=case["sp"])
    E = kw.pop("num_experts")
    return make_config(case["hidden"], E, ep, **kw)


def form_that_runs(cfg: MoEConfig, ep: int, etp: int) -> str | None:
    """The exchange form the dispatcher takes for ``cfg`` on gloo with CPU tensors, or None
    where the group may legitimately decide either way (dedup="auto"). The dispatcher's
    rules: padded capacity first; dedup when every rank forces it, K > 1, no expert TP and
    ep > 1, and the receive guard cuts nothing; then source-major rows (gloo, CPU, ep > 1,
    etp = 1, > 1 local expert), a regroup (> 1 source block and > 1 local expert), else
    the rows arrive expert-major."""
    r, L = cfg.router, cfg.num_experts // ep
    if r.pad_to_capacity:
        return "padded"
    dedup_possible = ep > 1 and etp == 1 and r.k > 1 and cfg.exchange.dedup != "off"
    if dedup_possible and (cfg.exchange.dedup == "auto" or cfg.exchange.receive_capacity_factor is not None
                           and cfg.exchange.receive_capacity_factor < ep):
        return None
    if dedup_possible:
        return "dedup"
    if ep * etp == 1 or L == 1:
        return "direct"
    return "source_major" if cfg.exchange.cpu_source_major and etp == 1 else "regroup"


def run_case(case: dict) -> list[dict]:
    """On every rank: ``compare_layouts``'s results for the case (one variant)."""
    tp, ep, etp = case["layout"]
    return compare_layouts(tp, ep, etp, [case["layer"]], case["uneven"], None, True, getattr(torch, case["dtype"]),
                    case["hidden"], case["sp"], expert_bias=case["expert_bias"])


def check(case: dict, per_rank: list) -> None:
    """AssertionError naming the rank and the figures where the form that ran is not the
    drawn one or a result misses tests/helpers/tolerances.py's tolerance of the case's dtype."""
    tol = tolerance(getattr(torch, case["dtype"]))
    for rank, (r,) in enumerate(per_rank):
        where = f"rank {rank} ({r['tokens']} tokens)"
        assert r["form"] == case["form"], f"{where}: the exchange took {r['form']!r}, drawn {case['form']!r}"
        figures = [("y", r["y"], r["y_scale"]), ("dx", r["dx"], r["dx_scale"])]
        figures += [(f"grad {n}", d, r["grad_scales"][n]) for n, d in r["grads"].items()]
        bad = [f"{what}: |diff| {d:.3g} > {tol.allowed(s):.3g} (scale {s:.3g})"
               for what, d, s in figures if not d <= tol.allowed(s)]
        assert not bad, f"{where}: " + "; ".join(bad)
        assert r["weights"] == 0.0, f"{where}: the layers' weights differ"
        assert r["ref_dropped"] is None or r["dropped"] == r["ref_dropped"], \
            f"{where}: dropped {r['dropped']} vs {r['ref_dropped']}"


def sweep(seconds: float, seed: int, world: int, cases: int | None = None, out=sys.stdout) -> tuple[int, int]:
    """Random cases on ``world`` gloo ranks for ``seconds`` (or ``cases`` of them), each
    printed with its error when it fails; (passed, failed)."""
    from .multiproc import run_ranks
    rng = random.Random(seed)
    ok = bad = 0
    t_end = time.time() + seconds
    while time.time() < t_end and (cases is None or ok + bad < cases):
        case = draw(rng)
        tp, ep, etp = case["layout"]
        if world % tp or world % (ep * etp):   # not a layout of this world
            continue
        try:
            check(case, run_ranks(run_case, world, case))
            ok += 1
        except Exception as e:   # report the case and go on
            bad += 1
            print("FAIL", case, "".join(traceback.format_exception_only(type(e), e))[-1500:], file=out, flush=True)
    print(f"sweep: {ok} cases passed, {bad} failed (seed {seed}, world {world})", file=out, flush=True)
    return ok, bad
