"""Validation rows for the real MoE layer's dispatch (``python -m moepar validate``).

Each row times ``Dispatcher.dispatch`` + ``combine`` (forward: the counts all-gather, the
token all-to-all and the one back, plus the local permute/regroup/unpermute they need) on
an EP group of n ranks with uniform random top-k routing, and compares it with what the
cost model prices for the same layer: the counts all-gather
(``traffic.message_bytes``) and two token all-to-alls of R·D·b, plus the
dispatcher's local passes over the R = T·K rows
(the permute before, the regroup of the received blocks by local expert and its inverse,
the weighted unpermute after), priced with the memory-bandwidth
line ``calibrate`` fits to exactly those passes (``row_pass_seconds``; profiles without
it price communication only). Rows carry op "moe_dispatch" to keep their error apart from
the plain collectives' medians.
"""
from __future__ import annotations

import torch

from ..moe.traffic import message_bytes
from ..moe.config import MoEConfig, RouterConfig
from ..moe.exchange.dispatcher import Dispatcher
from .calibrate import row_pass_seconds
from .validate import Row, ValidationContext, register_row_source

CASES = ((1024, 256), (4096, 256), (2048, 1024), (8192, 512))   # (T tokens per rank, D)
QUICK_CASES = ((256, 64), (512, 128))
TOPK, LOCAL_EXPERTS = 2, 2


def _routing(T: int, E: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)]) if T else \
        torch.zeros(0, TOPK, dtype=torch.long)


def moe_dispatch_rows(ctx: ValidationContext) -> list[Row]:
    rank = torch.distributed.get_rank()
    fns, cases = [], []
    for n in ctx.group_sizes:
        E = LOCAL_EXPERTS * n
        for T, D in (QUICK_CASES if ctx.quick else CASES):
            disp = Dispatcher(MoEConfig(D, E, n, router=RouterConfig(D, E, k=TOPK)), ep_group=ctx.groups[n])
            x = torch.randn(T, D, dtype=ctx.dtype, device=ctx.device)
            ids = _routing(T, E, seed=1000 * rank + T + D).to(ctx.device)
            w = torch.full((T, TOPK), 1.0 / TOPK, device=ctx.device)

            def fn(disp=disp, x=x, ids=ids, w=w):
                with torch.no_grad():
                    x_local, meta, _ = disp.dispatch(x, ids, None, w)
                    return disp.combine(x_local, meta)
            fns.append(fn)
            cases.append((n, T, D, E))
    # calibrated all-to-all points timed in the same rounds: the rows' drift since calibration
    measured = ctx.time_many(fns, [("all_to_all", n) for n in ctx.group_sizes])
    rows = []
    elem = ctx.bufs.elem
    for (n, T, D, E), m in zip(cases, measured):
        counts_bytes = message_bytes(E, n, n)
        token_bytes = T * TOPK * D * elem
        pred = (ctx.predict("all_gather", n, counts_bytes)[0] + 2 * ctx.predict("all_to_all", n, token_bytes)[0]
                + row_pass_seconds(ctx.hardware, token_bytes))
        rows.append(Row("moe-dispatch", f"n={n} T={T} D={D} K={TOPK} E={E}", "moe_dispatch", n,
                        token_bytes, pred, m, drift=ctx.drift))
    return rows


register_row_source(moe_dispatch_rows)
