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
