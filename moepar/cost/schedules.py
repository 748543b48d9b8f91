"""Pipeline schedules as the cost model prices them: names, rules, bubbles, memory in flight.

The names are those of the schedules ``torch.distributed.pipelining`` runs: ``gpipe``
(ScheduleGPipe), ``1f1b`` (Schedule1F1B), ``interleaved`` (ScheduleInterleaved1F1B, ``vp``
stages per rank, looped: rank r holds stages r, r + p, ...), ``zb`` (ScheduleInterleaved-
ZeroBubble: backward split into input and weight gradients, ``vp`` stages per rank, looped),
``zbv`` (ScheduleZBVZeroBubble) and ``dualpipev`` (ScheduleDualPipeV), 2 stages per rank in a
V: rank r holds stages r and 2p-1-r. The micro-batch rules are those of torch's constructors
and of ``moepar.parallel.pipeline`` (every multi-stage schedule at least p micro-batches).

Bubbles, in units of ``t``: one micro-batch's forward and full backward through all of a
rank's layers (F + B + W, with F = B = W = t/3: of the 6·N training FLOPs, 2 are the forward,
2 the input gradients, 2 the weight gradients). p ranks, m micro-batches, v stages per rank:

  gpipe, 1f1b   (p-1)·t                 GPipe (Huang et al. 2019); 1F1B (Narayanan et al.
                                        2021, sec. 2.2.1): fraction (p-1)/(m+p-1)
  interleaved   (p-1)·t/v               Narayanan et al. 2021 (Megatron-LM, sec. 2.2.2): the
                                        bubble time divided by v
  zb            (p-1)(F+B-W)/v = (p-1)·t/(3v)   ZB-H1 of Qi et al. 2024 ("Zero Bubble Pipeline
                                        Parallelism", ICLR; arXiv 2401.10241, sec. 3.1: 1F1B's
                                        (p-1)(F+B+W) less the W that fills it), divided by v as
                                        interleaving divides 1F1B's (an assumption: torch runs
                                        the interleaved ZB1P)
  dualpipev     (p-1)(F&B+B-3W) per chunk = (p-1)·t/3   DeepSeek-V3 report (arXiv 2412.19437,
                                        table 2) and the DualPipe README: (PP/2-1)(F&B+B-3W)
                                        with PP = 2p chunks; chunk times F = t/6, B (full) =
                                        t/3, W = t/6 and F&B = F + B (no credit for the overlap)
  zbv           0                       ZB-V (Qi et al. 2024; Sea AI Lab's zero-bubble README:
                                        bubble rate 0 with T_F = T_B = T_W, 1F1B's memory)

Activations in flight on the busiest (first) rank, in micro-batches through its layers:
GPipe m; 1F1B min(m, p - s) on stage s; interleaved and zb Megatron's warm-up count
(``get_num_warmup_microbatches``: 2(p - s - 1) + (v - 1)·p forward chunks, +1 in the steady
state) over v; DualPipeV PP + 1 = 2p + 1 chunks (DualPipe README), i.e. (2p + 1)/2; ZB-V
1F1B's p on every rank (its README: "1x" 1F1B's activation memory, balanced over ranks).
"""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv", "dualpipev")
MULTI_STAGE = ("interleaved", "zb", "zbv", "dualpipev")   # several stages per rank (torch's PipelineScheduleMulti)
V_SHAPED = ("zbv", "dualpipev")                            # exactly 2 stages per rank, in a V
TORCH_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
               "zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}


def default_vp(schedule: str) -> int:
    """Stages per rank a schedule runs unless told: 2 for the multi-stage ones, else 1."""
    check_schedule(schedule)
    return 2 if schedule in MULTI_STAGE else 1


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not a torch.distributed.pipelining schedule moepar runs; "
                         f"valid: {', '.join(SCHEDULES)}")


def check_pipeline(pp: int, vp: int, schedule: str, micro_batches: int | None = None,
                   layers: int | None = None) -> None:
    """One ValueError naming the value and the rule: a known schedule, stages per rank it can
    run, a chunk for every p·v, and torch's micro-batch rule for the schedule."""
    check_schedule(schedule)
    if schedule not in MULTI_STAGE and vp != 1:
        raise ValueError(f"vp={vp} needs a schedule with several stages per rank ({', '.join(MULTI_STAGE)}); "
                         f"schedule={schedule!r} runs one stage per rank (vp=1)")
    if schedule in V_SHAPED and vp != 2:
        raise ValueError(f"vp={vp}: schedule={schedule!r} runs exactly 2 stages per rank (a V); use vp=2")
    if layers is not None and pp * vp > layers:
        raise ValueError(f"pp x vp = {pp} x {vp} = {pp * vp} model chunks > layers={layers}: "
                         f"every pipeline stage needs at least one layer")
    if micro_batches is None or pp == 1:
        return
    m = micro_batches
    if schedule in ("1f1b", "interleaved", "zb", "zbv") and m < pp:
        raise ValueError(f"micro_batches={m} < pp={pp}: schedule {schedule!r} needs at least as many "
                         f"micro-batches as pipeline ranks")
    if schedule == "dualpipev" and m < 2 * pp:
        raise ValueError(f"micro_batches={m} < 2 x pp = {2 * pp}: schedule 'dualpipev' needs at least as many "
                         f"micro-batches as stages (2 per rank; torch's ScheduleDualPipeV)")
    if schedule in ("interleaved", "zb"):
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(f"micro_batches={m} is not a multiple of its rounds max(1, m // pp) = {rounds} "
                             f"(pp={pp}): schedule {schedule!r} needs it (torch's "
                             f"{TORCH_NAMES[schedule]})")


def bubble_units(schedule: str, pp: int, vp: int = 1) -> float:
    """The bubble in units of one micro-batch's forward + backward on one rank (module doc)."""
    check_schedule(schedule)
    p = pp - 1
    if schedule in ("gpipe", "1f1b"):
        return float(p)
    if schedule == "interleaved":
        return p / vp
    if schedule == "zb":
        f = b = w = 1.0 / 3.0                      # F, B (input gradients), W of one rank, units of t
        return p * (f + b - w) / vp
    if schedule == "zbv":
        return 0.0
    f, b_full, w = 1.0 / 6.0, 1.0 / 3.0, 1.0 / 6.0   # dualpipev: one chunk is half a rank's layers
    return p * ((f + b_full) + b_full - 3 * w)


def bubble_fraction(schedule: str, pp: int, micro_batches: int, vp: int = 1) -> float:
    """Idle share of the step: bubble / (m·t + bubble)."""
    u = bubble_units(schedule, pp, vp)
    return u / (micro_batches + u)


def in_flight(schedule: str, pp: int, micro_batches: int, vp: int = 1, stage: int = 0) -> float:
    """Micro-batches of activations (through all of a rank's layers) stage ``stage`` keeps."""
    check_schedule(schedule)
    m, p, v = micro_batches, pp, vp
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - stage))
    if schedule == "zbv":
        return float(min(m, p))
    if schedule == "dualpipev":
        return min(2 * m, 2 * p + 1) / 2
    return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1) / v


def chunk_rank(chunk: int, pp: int, vp: int, schedule: str) -> int:
    """The pipeline rank that runs model chunk ``chunk`` (of pp·vp): looped, or a V for dualpipev."""
    if schedule in V_SHAPED:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def chunk_bounds(layers: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk's layers: as even as the count allows (floor(k·L/C) cuts)."""
    cuts = [k * layers // chunks for k in range(chunks + 1)]
    return list(zip(cuts, cuts[1:]))
