"""A kill soak: train the example GPT-MoE under ``torchrun --max-restarts=K`` while one rank
is SIGKILLed K times (seeded), then compare with the same run never interrupted.

    python scripts/fault_soak.py [--kills 5] [--seed 0] [--steps 300] [--checkpoint-every 20]
                                 [--nproc 4] [--out runs/soak] [-- <train_gpt_moe.py arguments>]

Attempt i < K (torchrun's TORCHELASTIC_RESTART_COUNT) kills rank r_i inside the last MoE
layer's forward of its n_i-th training step in that attempt (r_i and n_i drawn from
``--seed``; n_i between half and twice ``--checkpoint-every``, so some kills land right
after a checkpoint and some lose steps that the next attempt redoes). Every attempt
resumes with ``--resume auto`` from the newest complete checkpoint. At the end it prints
the kills, the attempts torchrun started, whether the job finished, and the largest
difference between the final checkpoints (model and optimizer state) of the soaked run and
of an uninterrupted run of the same arguments; exit status 0 only if every kill was
survived and the two are equal within 1e-6.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(schedule_path: str, rest: list[str]) -> int:
    """One rank of one attempt: the example, with this attempt's kill installed."""
    sys.path.insert(0, ROOT)
    from examples import train_gpt_moe
    schedule = json.load(open(schedule_path))
    attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ.get("RANK", "0"))
    out = train_gpt_moe.parse_args(rest).out
    os.makedirs(out, exist_ok=True)
    if rank == 0:
        open(os.path.join(out, f"attempt_{attempt}"), "w").close()
    if attempt < len(schedule) and schedule[attempt]["rank"] == rank:
        build, at = train_gpt_moe.build, schedule[attempt]["step"]

        def build_with_kill(args, device):
            state, cfg, model, opt = build(args, device)
            last = [m for m in model.modules() if isinstance(m, train_gpt_moe.moepar.MoE)][-1]
            calls = [0]

            def pre_hook(module, inputs):
                calls[0] += module.training   # training forwards only (not evaluation)
                if module.training and calls[0] == at:
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
            last.register_forward_pre_hook(pre_hook)
            return state, cfg, model, opt
        train_gpt_moe.build = build_with_kill
    return train_gpt_moe.main(rest)


def _tensors(path: str) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    flat = path.rstrip("/") + ".pt"
    dcp_to_torch_save(path, flat)
    sd = torch.load(flat, weights_only=False)
    return {k: v for k, v in sd.items() if k.startswith(("model.", "optim."))}


def _largest_difference(a: dict, b: dict) -> float:
    import torch
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for key, value in a.items():
        if torch.is_tensor(value):
            worst = max(worst, float((value.double() - b[key].double()).abs().max()) if value.numel() else 0.0)
        elif value != b[key]:
            return float("inf")
    return worst


def _torchrun(nproc: int, restarts: int, script_args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={restarts}", "--monitor-interval=0.2", *script_args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--out", default="runs/soak")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    rng = random.Random(args.seed)
    every = args.checkpoint_every
    schedule = [{"rank": rng.randrange(args.nproc), "step": rng.randint(max(1, every // 2), 2 * every)}
                for _ in range(args.kills)]
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "schedule.json"), "w") as f:
        json.dump(schedule, f)
    common = [*rest, "--steps", str(args.steps), "--checkpoint-every", str(every), "--quiet"]
    t0 = time.time()
    ref = _torchrun(args.nproc, 0, ["examples/train_gpt_moe.py", *common, "--out", os.path.join(out, "reference")])
    t_ref = time.time() - t0
    soak_out = os.path.join(out, "soaked")
    soaked = _torchrun(args.nproc, args.kills, [
        "scripts/fault_soak.py", "--worker", os.path.join(out, "schedule.json"), "--",
        *common, "--out", soak_out, "--resume", "auto"])
    t_soak = time.time() - t0 - t_ref
    attempts = sorted(n for n in os.listdir(soak_out) if n.startswith("attempt_")) if os.path.isdir(soak_out) else []
    final = f"checkpoints/step_{args.steps}"
    diff = float("inf")
    if ref.returncode == 0 and soaked.returncode == 0:
        diff = _largest_difference(_tensors(os.path.join(out, "reference", final)),
                                   _tensors(os.path.join(soak_out, final)))
    survived = soaked.returncode == 0 and len(attempts) == args.kills + 1
    print(f"kills: {args.kills} (rank, step within its attempt): "
          f"{[(s['rank'], s['step']) for s in schedule]}")
    print(f"attempts started: {len(attempts)}; job finished: {soaked.returncode == 0}; "
          f"faults survived: {args.kills if survived else 0} of {args.kills}")
    print(f"final model and optimizer state vs the uninterrupted run: largest difference {diff:.3g} "
          f"({'equal' if diff <= 1e-6 else 'DIFFERENT'})")
    print(f"wall: uninterrupted {t_ref:.0f} s, soaked {t_soak:.0f} s")
    if soaked.returncode != 0 or ref.returncode != 0:
        print((soaked.stderr or ref.stderr)[-3000:], file=sys.stderr)
    return 0 if survived and diff <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
