"""The example's ``--resume auto`` with the checkpoint's guarantees: a crafted newest
checkpoint runs no code and stops the run with an error naming the file or entry; a run with
expert copies resumes at another ep and another number of copies."""
from __future__ import annotations

import json
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp

from examples import train_gpt_moe

from ..helpers.multiproc import run_ranks
from .test_checkpoint_safety import _Marker

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--context", "16", "--experts", "4",
        "--topk", "2", "--expert-ffn", "32", "--dense-ffn", "32", "--batch-size", "8",
        "--eval-interval", "1000", "--eval-batches", "1", "--sample-tokens", "0", "--quiet",
        "--log-interval", "1000", "--lr", "1e-2", "--warmup", "2", "--hardware", "h100"]


def test_resume_auto_refuses_a_crafted_newest_checkpoint(tmp_path, capsys):
    """Two runs resume a directory whose newest checkpoint is crafted: step_3 with an extra
    whose pickle would create a marker file, then step_4 whose ``.metadata`` would. Each
    exits with status 2 and an error naming the file and entry (or the file and class), and
    the marker never appears. Checked to fail without the fix: both created the marker."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out, marker = tmp_path / "run", tmp_path / "marker"
    ckpts = out / "checkpoints"
    argv = TINY + ["--out", str(out), "--checkpoint-every", "1"]
    assert train_gpt_moe.main(argv + ["--steps", "2"]) == 0
    dcp_to_torch_save(str(ckpts / "step_2"), str(tmp_path / "flat.pt"))
    sd = torch.load(str(tmp_path / "flat.pt"), weights_only=False)   # our own file: trusted
    sd["extra.metrics"] = pickle.dumps(_Marker(marker))
    dcp.save(sd, checkpoint_id=str(ckpts / "step_3"), no_dist=True)
    capsys.readouterr()
    assert train_gpt_moe.main(argv + ["--steps", "5", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"{ckpts / 'step_3' / '__0_0.distcp'}: entry extra.metrics: written by an earlier moepar as a " \
           f"pickle that names posix.system" in err, err[-2000:]
    dcp.save(sd, checkpoint_id=str(ckpts / "step_4"), no_dist=True)
    with open(ckpts / "step_4" / ".metadata", "wb") as f:
        pickle.dump(_Marker(marker), f)
    assert train_gpt_moe.main(argv + ["--steps", "5", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"{ckpts / 'step_4' / '.metadata'}: refused: it names posix.system" in err, err[-2000:]
    assert not marker.exists()


def _run(argv):
    m = train_gpt_moe.train(train_gpt_moe.parse_args(argv))
    return m["losses"], m.get("resumed_at"), m.get("rebalances", [])


def test_resume_auto_with_copies_at_another_ep_and_number_of_copies(tmp_path):
    """``--redundant-experts 2 --rebalance-every 1`` at ep2 for 3 steps (checkpoint at 2),
    resumed with ``--resume auto`` at ep4 with 4 copies: the resumed run re-plans each layer
    from its saved load and trains on; its losses stay those of the same model (within
    1e-4 of the uninterrupted ep2 run: copies change where experts run, not what they
    compute). Checked to fail without the fix: "placement for E=4, X=2, ep=2 does not fit
    this layer's E=4, X=4, ep=4"."""
    out = str(tmp_path / "run")
    common = TINY + ["--rebalance-every", "1", "--checkpoint-every", "2", "--out", out]
    first = run_ranks(_run, 2, common + ["--ep", "2", "--redundant-experts", "2", "--steps", "3"])[0]
    os.rename(os.path.join(out, "checkpoints", "step_3"), os.path.join(out, "step_3_moved"))
    resumed = run_ranks(_run, 4, common + ["--ep", "4", "--redundant-experts", "4", "--steps", "4", "--resume", "auto"])
    for losses, resumed_at, rebalances in resumed:
        assert resumed_at == 2 and len(losses) == 4
        assert max(abs(a - b) for a, b in zip(losses[:3], first[0])) <= 1e-4, (losses, first[0])
        assert {r[0] for r in rebalances} == {1, 2, 3, 4}
    assert json.load(open(os.path.join(out, "metrics.json")))["resumed_at"] == 2


def _reference(argv):
    train_gpt_moe.train(train_gpt_moe.parse_args(argv))


def test_sigkills_inside_saves_resume_from_the_newest_complete_checkpoint(tmp_path):
    """scripts/fault_soak.py --kill-in save at its smallest: 2 ranks under torchrun, rank 0
    SIGKILLed while only DCP's .metadata was left to write (in the second save of the first
    attempt), then rank 1 SIGKILLed partway through writing its shard file (in the first save
    of the second attempt). Every restart resumes from the newest checkpoint whose save
    finished (step_2 both times: never the half-written step_4), the losses of every step are
    those of the uninterrupted run and the final state is bitwise equal. (docs/faults.md
    gives the same script at 12 kills.)"""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out, ref = tmp_path / "soak", tmp_path / "reference"
    args = [*TINY, "--ep", "2", "--steps", "4", "--checkpoint-every", "2"]
    run_ranks(_reference, 2, args + ["--out", str(ref)])
    cmd = [sys.executable, "scripts/fault_soak.py", "--kill-in", "save", "--kills", "2", "--seed", "17",
           "--steps", "4", "--checkpoint-every", "2", "--nproc", "2", "--out", str(out), "--reference", str(ref),
           "--", *TINY, "--ep", "2"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for line in ("kills that happened: 2", "faults survived: 2 of 2", "newest complete checkpoint, every "
                 "step_<n> left is complete: True", "every step vs the uninterrupted run: identical", "(equal)"):
        assert line in proc.stdout, proc.stdout
    events = [json.loads(line) for line in open(out / "soaked" / "events.jsonl")]
    kills = [(e["rank"], e["kill"]["point"], e["kill"]["step"]) for e in events if "kill" in e]
    assert kills == [(0, "metadata", 4), (1, "shard", 4)]
    assert [e["resumed"] for e in events if "resumed" in e] == ["step_2", "step_2"]
