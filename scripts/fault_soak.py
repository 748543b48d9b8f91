"""A kill soak: train the example GPT-MoE under ``torchrun --max-restarts=K`` while one rank
is SIGKILLed K times (seeded), then compare with the same run never interrupted.

    python scripts/fault_soak.py [--kills 5] [--seed 0] [--steps 300] [--checkpoint-every 20]
                                 [--nproc 4] [--kill-in forward|save] [--out runs/soak]
                                 [--reference DIR] [-- <train_gpt_moe.py arguments>]

Attempt i < K (torchrun's TORCHELASTIC_RESTART_COUNT) kills one rank r_i, drawn from
``--seed``. ``--kill-in forward`` (default): inside the last MoE layer's forward of its
n_i-th training step in that attempt (n_i between half and twice ``--checkpoint-every``, so
some kills land right after a checkpoint and some lose steps that the next attempt redoes).
``--kill-in save``: inside its n_i-th ``save_checkpoint`` of the attempt (n_i in 1..3), at
one of ``SAVE_POINTS``: while DCP writes the rank's shard files (before a drawn item, so the
file is cut short), after its shards but before DCP's ``.metadata`` (rank 0 only writes
that: the "metadata" point is rank 0's), or after everything is written but before the
rename to ``step_<n>``.

Every attempt resumes with ``--resume auto`` from the newest complete checkpoint. At the end
it prints the kills, the attempts torchrun started, whether every restart resumed from the
newest checkpoint whose save had finished (and every ``step_<n>`` left on disk is
complete), whether the losses of every step equal the uninterrupted run's, and the largest
difference between the final checkpoints (model and optimizer state) of the two runs; exit
status 0 only if every kill happened and was survived, every restart resumed from the
newest complete checkpoint, and the runs are equal (losses exactly, state within 1e-6).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVE_POINTS = ("shard", "after-shards", "metadata", "before-rename")


def _record(out: str, **event) -> None:
    """One line of ``<out>/events.jsonl`` (appended, flushed: the writer may be killed next)."""
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")


def _kill(out: str, attempt: int, rank: int, **where) -> None:
    _record(out, attempt=attempt, rank=rank, kill=where)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _install_save_kill(train_gpt_moe, kill: dict, out: str, attempt: int, rank: int) -> None:
    """SIGKILL this rank at ``kill["point"]`` inside its ``kill["save"]``-th save_checkpoint."""
    import torch.distributed.checkpoint.filesystem as fs
    from moepar import checkpoint
    calls, items = [0], [0, 0]   # saves begun; (items written, the item to die before) in this save
    armed = lambda: calls[0] == kill["save"]   # noqa: E731
    where = lambda: {k: v for k, v in dict(kill, step=step[0]).items() if k != "rank"}   # noqa: E731
    step = [0]
    save_checkpoint, save, write_data, finish, write_item = (
        checkpoint.save_checkpoint, checkpoint.save, fs.FileSystemWriter.write_data,
        fs.FileSystemWriter.finish, fs._write_item)

    def counted_save_checkpoint(root, at_step, *args, **kwargs):
        calls[0] += 1
        step[0] = at_step
        return save_checkpoint(root, at_step, *args, **kwargs)

    def killing_write_data(self, plan, planner):
        items[:] = [0, 1 + int(kill["fraction"] * len(plan.items))]
        result = write_data(self, plan, planner)
        if armed() and kill["point"] == "after-shards":
            _kill(out, attempt, rank, **where())
        return result

    def killing_write_item(*args, **kwargs):
        items[0] += 1
        if armed() and kill["point"] == "shard" and items[0] == items[1]:
            _kill(out, attempt, rank, **where(), item=items[0])
        return write_item(*args, **kwargs)

    def killing_finish(self, *args, **kwargs):
        if armed() and kill["point"] == "metadata":
            _kill(out, attempt, rank, **where())
        return finish(self, *args, **kwargs)

    def killing_save(*args, **kwargs):
        save(*args, **kwargs)
        if armed() and kill["point"] == "before-rename":
            _kill(out, attempt, rank, **where())

    train_gpt_moe.checkpoint.save_checkpoint = counted_save_checkpoint
    checkpoint.save = killing_save   # what save_checkpoint calls
    fs.FileSystemWriter.write_data, fs.FileSystemWriter.finish = killing_write_data, killing_finish
    fs._write_item = killing_write_item


def _install_records(train_gpt_moe, out: str, attempt: int) -> None:
    """Rank 0 records where each attempt resumed from and each save that finished."""
    load, save_checkpoint = train_gpt_moe.checkpoint.load, train_gpt_moe.checkpoint.save_checkpoint

    def recorded_load(path, *args, **kwargs):
        _record(out, attempt=attempt, resumed=os.path.basename(path))
        return load(path, *args, **kwargs)

    def recorded_save_checkpoint(root, at_step, *args, **kwargs):
        path = save_checkpoint(root, at_step, *args, **kwargs)
        _record(out, attempt=attempt, saved=os.path.basename(path))
        return path
    train_gpt_moe.checkpoint.load = recorded_load
    train_gpt_moe.checkpoint.save_checkpoint = recorded_save_checkpoint


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
        _record(out, attempt=attempt, start=True)
    kill = schedule[attempt] if attempt < len(schedule) and schedule[attempt]["rank"] == rank else None
    if kill is not None and "point" in kill:
        _install_save_kill(train_gpt_moe, kill, out, attempt, rank)
    elif kill is not None:
        build, at = train_gpt_moe.build, kill["step"]

        def build_with_kill(args, device):
            state, cfg, model, opt = build(args, device)
            last = [m for m in model.modules() if isinstance(m, train_gpt_moe.moepar.MoE)][-1]
            calls = [0]

            def pre_hook(module, inputs):
                calls[0] += module.training   # training forwards only (not evaluation)
                if module.training and calls[0] == at:
                    _kill(out, attempt, rank, step=at)
            last.register_forward_pre_hook(pre_hook)
            return state, cfg, model, opt
        train_gpt_moe.build = build_with_kill
    if rank == 0:
        _install_records(train_gpt_moe, out, attempt)
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


def _schedule(args) -> list[dict]:
    rng = random.Random(args.seed)
    every, out = args.checkpoint_every, []
    for _ in range(args.kills):
        rank = rng.randrange(args.nproc)
        if args.kill_in == "forward":
            out.append({"rank": rank, "step": rng.randint(max(1, every // 2), 2 * every)})
        else:
            point = rng.choice(SAVE_POINTS)
            out.append({"rank": 0 if point == "metadata" else rank, "point": point,
                        "save": rng.randint(1, 3), "fraction": round(rng.random(), 3)})
    return out


def _resumes_checked(soak_out: str) -> tuple[int, list[str]]:
    """(kills that happened, problems): each attempt after the first must resume from the
    newest checkpoint whose save had finished before it, and every step_<n> left is whole."""
    sys.path.insert(0, ROOT)
    from moepar.checkpoint.reading import _check_files
    from moepar.checkpoint.safe import CheckpointError, checked_reader
    events = [json.loads(line) for line in open(os.path.join(soak_out, "events.jsonl"))] \
        if os.path.exists(os.path.join(soak_out, "events.jsonl")) else []
    problems, newest, expected, resumed = [], None, {}, {}
    for e in events:
        if "start" in e:
            expected[e["attempt"]] = newest
        elif "saved" in e:
            newest = max(newest or e["saved"], e["saved"], key=lambda d: int(d.split("_")[1]))
        elif "resumed" in e:
            resumed[e["attempt"]] = e["resumed"]
    for attempt, want in sorted(expected.items()):
        if resumed.get(attempt) != want:
            problems.append(f"attempt {attempt} resumed from {resumed.get(attempt)}, the newest finished save "
                            f"before it was {want}")
    ckpts = os.path.join(soak_out, "checkpoints")
    for d in sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else []:
        if d.startswith("step_") and os.path.isdir(os.path.join(ckpts, d)):
            try:
                _check_files(os.path.join(ckpts, d), checked_reader(os.path.join(ckpts, d))[1])
            except CheckpointError as e:
                problems.append(f"{d} is not a complete checkpoint: {e}")
    return sum(1 for e in events if "kill" in e), problems


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
    p.add_argument("--kill-in", choices=["forward", "save"], default="forward",
                   help="where the kills land: a training step's forward, or inside save_checkpoint")
    p.add_argument("--out", default="runs/soak")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="the --out of an uninterrupted run of the same arguments (else one is run first)")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    schedule = _schedule(args)
    out = os.path.abspath(args.out)
    soak_out = os.path.join(out, "soaked")
    ref_out = os.path.abspath(args.reference) if args.reference else os.path.join(out, "reference")
    for d in (soak_out, None if args.reference else ref_out):   # a previous soak's would read as this one's
        if d:
            shutil.rmtree(d, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "schedule.json"), "w") as f:
        json.dump(schedule, f)
    common = [*rest, "--steps", str(args.steps), "--checkpoint-every", str(args.checkpoint_every), "--quiet"]
    t0 = time.time()
    ref = subprocess.CompletedProcess([], 0, "", "") if args.reference else \
        _torchrun(args.nproc, 0, ["examples/train_gpt_moe.py", *common, "--out", ref_out])
    t_ref = time.time() - t0
    soaked = _torchrun(args.nproc, args.kills, [
        "scripts/fault_soak.py", "--worker", os.path.join(out, "schedule.json"), "--",
        *common, "--out", soak_out, "--resume", "auto"])
    t_soak = time.time() - t0 - t_ref
    attempts = sorted(n for n in os.listdir(soak_out) if n.startswith("attempt_")) if os.path.isdir(soak_out) else []
    final = f"checkpoints/step_{args.steps}"
    diff, same_losses = float("inf"), False
    if ref.returncode == 0 and soaked.returncode == 0:
        diff = _largest_difference(_tensors(os.path.join(ref_out, final)), _tensors(os.path.join(soak_out, final)))
        losses = [json.load(open(os.path.join(d, "metrics.json")))["losses"] for d in (ref_out, soak_out)]
        same_losses = losses[0] == losses[1] and len(losses[0]) == args.steps
    killed, problems = _resumes_checked(soak_out)
    survived = soaked.returncode == 0 and len(attempts) == args.kills + 1 and killed == args.kills
    where = [(s["rank"], s["step"]) if "step" in s else (s["rank"], s["point"], s["save"]) for s in schedule]
    print(f"kills: {args.kills} (rank, " + ("step within its attempt" if args.kill_in == "forward" else
                                          "point, which save of its attempt") + f"): {where}")
    print(f"attempts started: {len(attempts)}; kills that happened: {killed}; job finished: {soaked.returncode == 0}; "
          f"faults survived: {args.kills if survived else 0} of {args.kills}")
    print(f"every restart resumed from the newest complete checkpoint, every step_<n> left is complete: "
          f"{not problems}" + "".join(f"\n  {p}" for p in problems))
    print(f"losses of every step vs the uninterrupted run: {'identical' if same_losses else 'DIFFERENT'}")
    print(f"final model and optimizer state vs the uninterrupted run: largest difference {diff:.3g} "
          f"({'equal' if diff <= 1e-6 else 'DIFFERENT'})")
    print(f"wall: uninterrupted {t_ref:.0f} s, soaked {t_soak:.0f} s")
    if soaked.returncode != 0 or ref.returncode != 0:
        print((soaked.stderr or ref.stderr)[-3000:], file=sys.stderr)
    return 0 if survived and not problems and same_losses and diff <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
