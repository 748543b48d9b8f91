"""FP8 dispatch accuracy: the MoE layer's error on random and on trained activations, and
two training runs (compute-dtype dispatch vs FP8 dispatch) side by side.

    # the two runs (same seed), then this script on their output folders:
    bash scripts/main.sh --out runs/base
    bash scripts/main.sh --out runs/fp8 --dispatch-dtype fp8
    python scripts/fp8_accuracy.py --runs runs/base runs/fp8 --plot docs/fp8_dispatch_loss.png

The dispatch all-to-all only moves rows, so the FP8 layer equals (tests/moe/test_fp8_dispatch.py,
within 1e-6) one process whose experts see the quantize-dequantize of their rows: that is
what is measured here, in one process. Errors: relative RMS (||y8 - y|| / ||y||) and the
largest element error relative to max |y|.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import moepar  # noqa: E402
from moepar import checkpoint  # noqa: E402
from moepar.moe.exchange import fp8  # noqa: E402


def _quantized_rows(module, args):
    return (fp8.fake_quantize(args[0]),) + tuple(args[1:])


def _errors(moe, x, autocast: torch.dtype | None = None) -> tuple[float, float]:
    """(relative RMS, max error / max |y|) of the layer with FP8 rows against without."""
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = moe(x).float()
        h = moe.experts.register_forward_pre_hook(_quantized_rows)
        try:
            y8 = moe(x).float()
        finally:
            h.remove()
    return float((y8 - y).norm() / y.norm()), float((y8 - y).abs().max() / y.abs().max())


def random_activations(tokens: int = 512, D: int = 512, F: int = 1024, E: int = 8, k: int = 2) -> list[tuple]:
    moepar.init_parallel()
    torch.manual_seed(0)
    moe = moepar.MoE(D, E, 1, ffn_hidden=F, k=k, activation="swiglu", init_seed=0)
    x = torch.randn(tokens, D)
    return [(f"random N(0,1), T={tokens} D={D} F={F} E={E} top-{k} SwiGLU, fp32", *_errors(moe, x)),
            (f"random N(0,1), same layer under bf16 autocast (vs the bf16 dispatch)",
             *_errors(moe, x, torch.bfloat16))]


def _trained(run_dir: str):
    """The run's final model in one process (the checkpoint is layout-free), its args and
    the example's validation batches."""
    from examples.data import Batches, load_corpus
    from examples.gpt_moe import GPT, GPTConfig
    with open(os.path.join(run_dir, "metrics.json")) as f:
        a = json.load(f)["args"]
    state = moepar.init_parallel()
    cfg = GPTConfig(context=a["context"], layers=a["layers"], hidden=a["hidden"], heads=a["heads"],
                    experts=a["experts"], topk=a["topk"], moe_every=a["moe_every"], expert_ffn=a["expert_ffn"],
                    dense_ffn=a["dense_ffn"], capacity_factor=a["capacity_factor"],
                    aux_loss_coeff=a["aux_loss_coeff"], z_loss_coeff=a["z_loss_coeff"], init_seed=a["seed"])
    model = GPT(cfg, state)
    path = checkpoint.latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    if path is None:
        raise SystemExit(f"no checkpoint under {run_dir}/checkpoints: train with the example first")
    checkpoint.load(path, model, state=state)
    model.eval()
    corpus = load_corpus(a["data"], a["context"])
    return model, Batches(corpus.val, a["context"], a["batch_size"], a["seed"] + 1)


def validation_loss(run_dir: str, batches: int, fp8_rows: bool) -> float:
    """The final model's loss on the example's first ``batches`` validation batches (the
    run evaluates 4), its experts fed FP8 rows when the run dispatched them."""
    model, val = _trained(run_dir)
    hooks = [m.experts.register_forward_pre_hook(_quantized_rows)
             for m in model.modules() if isinstance(m, moepar.MoE)] if fp8_rows else []
    with torch.no_grad():
        losses = [float(model(*val.get(10_000_000 + i, 0, 1))) for i in range(batches)]
    for h in hooks:
        h.remove()
    return sum(losses) / len(losses)


def trained_activations(run_dir: str, batches: int = 4) -> list[tuple]:
    """The inputs of every MoE layer of the run's final checkpoint on validation batches."""
    model, val = _trained(run_dir)
    layers = [m for m in model.modules() if isinstance(m, moepar.MoE)]
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0].detach().reshape(-1, args[0].shape[-1])))
             for i, m in enumerate(layers)]
    with torch.no_grad():
        for i in range(batches):   # the example's own validation batches
            x, _ = val.get(10_000_000 + i, 0, 1)
            model(x)
    for h in hooks:
        h.remove()
    rows = []
    for i, m in enumerate(layers):
        rows.append((f"trained: MoE layer {i} inputs, {sum(t.shape[0] for t in seen[i])} tokens", *_errors(m, torch.cat(seen[i]))))
    return rows


def curves(base: str, fp8_dir: str, plot: str | None) -> dict:
    runs = {}
    for name, d in (("compute-dtype dispatch", base), ("FP8 dispatch", fp8_dir)):
        with open(os.path.join(d, "metrics.json")) as f:
            runs[name] = json.load(f)
    vb, v8 = runs["compute-dtype dispatch"]["val"][-1][1], runs["FP8 dispatch"]["val"][-1][1]
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for (name, m), c in zip(runs.items(), ("tab:blue", "tab:red")):
            ax.plot(range(1, len(m["losses"]) + 1), m["losses"], color=c, alpha=0.5, lw=1, label=f"{name}: train")
            ax.plot(*zip(*m["val"]), "o-", color=c, label=f"{name}: validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        a = runs["FP8 dispatch"]["args"]
        ax.set_title(f"example GPT-MoE, tp{a['tp']}·ep{a['ep']}, {a['steps']} steps, seed {a['seed']} (both runs)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
    return {"val_base": vb, "val_fp8": v8, "relative": (v8 - vb) / vb}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs=2, metavar=("BASE_DIR", "FP8_DIR"), default=None,
                   help="the example's --out folders of the compute-dtype and the FP8 run")
    p.add_argument("--plot", default=None, help="write both loss curves to this PNG")
    p.add_argument("--eval-batches", type=int, default=32,
                   help="validation batches for the final models' losses (the runs log 4)")
    args = p.parse_args(argv)
    rows = random_activations()
    if args.runs:
        rows += trained_activations(args.runs[0])
    print("| activations | relative RMS error | max error / max abs output |")
    print("|---|---|---|")
    for name, rms, mx in rows:
        print(f"| {name} | {rms:.2%} | {mx:.2%} |")
    if args.runs:
        c = curves(*args.runs, args.plot)
        print(f"\nfinal validation loss (the runs' 4 batches): compute-dtype dispatch {c['val_base']:.4f}, "
              f"FP8 dispatch {c['val_fp8']:.4f} ({c['relative']:+.2%})")
        vb = validation_loss(args.runs[0], args.eval_batches, False)
        v8 = validation_loss(args.runs[1], args.eval_batches, True)
        print(f"final models on {args.eval_batches} validation batches: compute-dtype dispatch {vb:.4f}, "
              f"FP8 dispatch {v8:.4f} ({(v8 - vb) / vb:+.2%})")


if __name__ == "__main__":
    main()
