"""The cost of transformers' layouts: a swapped block (``HFMoEBlock``, its experts held as
transformers' ``gate_up_proj`` / ``down_proj``) against the same layer in moepar's own
layout (``w1`` / ``w3`` / ``w2``), forward + backward, interleaved.

    python -m moepar.hf.bench [--families mixtral,gpt_oss] [--tokens 1024] [--hidden 512]
                              [--ffn 1792] [--experts 8] [--rounds 24]

Both layers are built from one transformers block of the family (one process, fp32, the
same weights, the same routing), so the only difference is where the expert tensors live.
Each round times one step of each (``zero_grad(set_to_none=True)``, forward, ``sum(y * g)``
backward), in alternating order; the table gives the medians, the median of the per-round
ratios (HF layout / moepar layout), which a drift of the machine's speed during the run moves
least, and the minor page faults per step (a fresh buffer of a few MiB or more is faulted in
page by page). ``--clock cpu`` counts the process's CPU seconds instead of wall time: on a
machine shared with other jobs wall time mostly measures the scheduler (with ``--threads 1``,
so that no idle thread's spinning is counted).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

# config fields giving the block's sizes, per family (transformers' names)
_SIZES = {
    "mixtral": ("MixtralConfig", "intermediate_size", "num_local_experts"),
    "qwen3_moe": ("Qwen3MoeConfig", "moe_intermediate_size", "num_experts"),
    "gpt_oss": ("GptOssConfig", "intermediate_size", "num_local_experts"),
    "llama4_text": ("Llama4TextConfig", "intermediate_size", "num_local_experts"),
    "switch_transformers": ("SwitchTransformersConfig", "d_ff", "num_experts"),
}


def _block(family: str, hidden: int, ffn: int, experts: int, k: int):
    """(config, transformers' block of ``family``) at these sizes, fp32, eval mode."""
    import importlib

    import transformers
    from .families import family_of
    cls_name, ffn_key, experts_key = _SIZES[family]
    kw = {ffn_key: ffn, experts_key: experts}
    if family == "switch_transformers":
        cfg = transformers.SwitchTransformersConfig(d_model=hidden, expert_capacity=1 << 30, **kw)
    else:
        cfg = getattr(transformers, cls_name)(hidden_size=hidden, num_experts_per_tok=k, num_attention_heads=8,
                                              num_key_value_heads=8, head_dim=hidden // 8, **kw)
    fam = family_of(cfg)
    mod = importlib.import_module(f"transformers.models.{family.split('_text')[0]}.modeling_{family.split('_text')[0]}")
    blk = getattr(mod, fam.block_class)(cfg).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():   # the block's constructor leaves its tensors uninitialised
        for _, t in sorted(list(blk.named_parameters()) + list(blk.named_buffers())):
            t.copy_(torch.randn(t.shape, generator=gen) * hidden ** -0.5)
    return cfg, blk


def pair(family: str, hidden: int = 512, ffn: int = 1792, experts: int = 8, k: int = 2):
    """(moepar-layout ``MoE``, ``HFMoEBlock``) of one transformers block: equal weights."""
    from . import HFMoEBlock, convert_block, family_of
    cfg, blk = _block(family, hidden, ffn, experts, k)
    ours = convert_block(blk, cfg)
    hf = HFMoEBlock(convert_block(blk, cfg), family_of(cfg), cfg)
    return ours, hf


def step_fn(module, x: torch.Tensor, g: torch.Tensor):
    """One training step's forward + backward of ``module`` (gradients set to None first)."""
    def step():
        module.zero_grad(set_to_none=True)
        y = module(x)
        y = y[0] if isinstance(y, tuple) else y
        (y.reshape(g.shape) * g).sum().backward()
    return step


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run(family: str, tokens: int, hidden: int, ffn: int, experts: int, k: int, rounds: int, warmup: int = 2,
        clock: str = "wall") -> dict:
    """Medians (seconds, page faults) of each layout's step and of the per-round ratios."""
    ours, hf = pair(family, hidden, ffn, experts, k)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=gen)
    g = torch.randn(1, tokens, hidden, generator=gen)
    steps = {"moepar": step_fn(ours, x, g), "hf": step_fn(hf, x, g)}
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    now = time.perf_counter if clock == "wall" else time.process_time
    times = {name: [] for name in steps}
    faults = {name: [] for name in steps}
    for r in range(rounds):
        for name in (("moepar", "hf") if r % 2 == 0 else ("hf", "moepar")):
            f0, t0 = _faults(), now()
            steps[name]()
            times[name].append(now() - t0)
            faults[name].append(_faults() - f0)
    ratios = [h / m for h, m in zip(times["hf"], times["moepar"])]
    med = statistics.median
    return {"moepar": med(times["moepar"]), "hf": med(times["hf"]), "ratio": med(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "faults_moepar": med(faults["moepar"]), "faults_hf": med(faults["hf"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moepar.hf.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="mixtral,gpt_oss",
                    help=f"comma-separated, of {sorted(_SIZES)} (default: mixtral,gpt_oss)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1792)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("-k", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or this process's CPU seconds (steadier on a shared machine)")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    bad = [f for f in families if f not in _SIZES]
    if bad:
        ap.error(f"--families {bad}: known {sorted(_SIZES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"forward + backward, fp32, T {args.tokens}, D {args.hidden}, F {args.ffn}, E {args.experts}, "
          f"k {args.k}, {args.rounds} interleaved rounds, {args.clock} clock, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'family':<20} {'layout':<13} {'moepar ms':>10} {'HF ms':>10} {'HF / moepar':>12} {'(min - max)':>15}"
          f" {'faults moepar':>14} {'faults HF':>10}")
    from .families import family_of
    for fam in families:
        r = run(fam, args.tokens, args.hidden, args.ffn, args.experts, args.k, args.rounds, clock=args.clock)
        layout = family_of(type("C", (), {"model_type": fam})).layout
        spread = f"({r['ratio_min']:.3f} - {r['ratio_max']:.3f})"
        print(f"{fam:<20} {layout:<13} {r['moepar'] * 1e3:>10.1f} {r['hf'] * 1e3:>10.1f} {r['ratio']:>12.3f} "
              f"{spread:>15} {r['faults_moepar']:>14.0f} {r['faults_hf']:>10.0f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
