"""The GPT-MoE example: layouts agree, resume across layouts, data errors, crash safety."""
import os
import signal
import subprocess
import sys
import time

import pytest

from examples import train_gpt_moe
from examples.data import load_corpus

from ..helpers.multiproc import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--context", "16", "--experts", "4",
        "--topk", "2", "--expert-ffn", "32", "--dense-ffn", "32", "--batch-size", "8",
        "--eval-interval", "1000", "--eval-batches", "1", "--sample-tokens", "0", "--quiet",
        "--log-interval", "1000"]


def _train(argv):
    return train_gpt_moe.train(train_gpt_moe.parse_args(argv))["losses"]


def test_layouts_agree_on_the_first_losses(tmp_path):
    common = TINY + ["--steps", "5", "--lr", "1e-2", "--warmup", "2"]
    single = _train(common + ["--out", str(tmp_path / "single")])
    assert len(single) == 5 and single[-1] < single[0]
    for tp, ep in [(2, 2), (1, 4)]:
        out = str(tmp_path / f"tp{tp}ep{ep}")
        per_rank = run_ranks(_train, 4, common + ["--tp", str(tp), "--ep", str(ep), "--out", out])
        assert len(per_rank) == 4
        for rank, losses in enumerate(per_rank):   # every rank, not only rank 0
            assert len(losses) == 5, (tp, ep, rank, losses)
            assert max(abs(a - b) for a, b in zip(losses, single)) <= 1e-4, (tp, ep, rank, losses, single)


class _Interrupted(Exception):
    pass


def _train_interrupted(argv, stop_at):
    """The example, crashing right after it saved the checkpoint of step ``stop_at`` (what
    it had in memory is lost; a resumed run has only the files). Returns the losses it had
    logged by then, and the checkpoint's path."""
    saved = train_gpt_moe.checkpoint.save_checkpoint
    logged = []

    def save_then_crash(root, step, model, opt, extra, state):
        path = saved(root, step, model, opt, extra, state)
        if step == stop_at:
            logged.extend(extra["metrics"]["losses"])
            raise _Interrupted(path)
        return path
    train_gpt_moe.checkpoint.save_checkpoint = save_then_crash
    try:
        train_gpt_moe.train(train_gpt_moe.parse_args(argv))
    except _Interrupted as e:
        return logged, str(e)
    finally:
        train_gpt_moe.checkpoint.save_checkpoint = saved
    raise AssertionError(f"the run ended without saving step {stop_at}")


def _train_metrics(argv):
    m = train_gpt_moe.train(train_gpt_moe.parse_args(argv))
    return m["losses"], m.get("resumed_at")


def test_resume_under_another_layout_continues_the_same_curve(tmp_path):
    # Uninterrupted: 6 steps at tp=2 ep=2. Interrupted: the same run crashing after saving
    # step 3, resumed from its files at tp=1 ep=4. The resumed run's own losses of steps
    # 4..6 (the model, optimizer, lr schedule and data order all resumed) continue the
    # uninterrupted curve, on every rank; the steps before come from the checkpoint.
    common = TINY + ["--steps", "6", "--lr", "1e-2", "--warmup", "2"]
    full = run_ranks(_train, 4, common + ["--tp", "2", "--ep", "2", "--out", str(tmp_path / "full")])
    assert all(losses == full[0] for losses in full)   # the dp-mean loss, identical on every rank
    out = str(tmp_path / "interrupted")
    first = run_ranks(_train_interrupted, 4, common + ["--tp", "2", "--ep", "2", "--out", out,
                                                       "--checkpoint-every", "3"], 3)
    for rank, (logged, path) in enumerate(first):
        assert path.endswith("step_3") and len(logged) == 3, (rank, path, logged)
        assert max(abs(a - b) for a, b in zip(logged, full[rank][:3])) <= 1e-6, (rank, logged, full[rank])
    resumed = run_ranks(_train_metrics, 4, common + ["--ep", "4", "--out", out, "--resume"])
    for rank, (losses, resumed_at) in enumerate(resumed):
        assert resumed_at == 3 and len(losses) == 6, (rank, resumed_at, losses)
        new = losses[3:]     # computed by the resumed run itself
        assert max(abs(a - b) for a, b in zip(new, full[rank][3:])) <= 1e-5, (rank, new, full[rank])
        assert abs(new[0] - full[rank][0]) > 1e-3   # not a restart from step 1


def test_data_errors_are_clear(tmp_path, capsys):
    with pytest.raises(ValueError, match="no such file or folder"):
        load_corpus(str(tmp_path / "missing.txt"), 16)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="the data is empty"):
        load_corpus(str(empty), 16)
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 30)
    with pytest.raises(ValueError, match="needs at least context\\+2 = 18 bytes"):
        load_corpus(str(short), 16)
    assert train_gpt_moe.main(TINY + ["--data", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "error: --data" in capsys.readouterr().err
    corpus = load_corpus(None, 128)
    assert len(corpus.train) > 1_000_000 and len(corpus.val) > 100_000


def test_killed_run_resumes_from_last_complete_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt_moe.py")] + TINY + [
        "--steps", "400", "--checkpoint-every", "2", "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpts = os.path.join(out, "checkpoints")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.isdir(ckpts) and
                                          len([d for d in os.listdir(ckpts) if d.startswith("step_")]) >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-step, possibly mid-save
    proc.wait()
    from moepar.checkpoint import latest_checkpoint
    last = latest_checkpoint(ckpts)
    assert last is not None, proc.stderr.read().decode()[-2000:]
    done = int(last.rsplit("_", 1)[1])
    resumed = subprocess.run(cmd[:-4] + ["--steps", str(done + 2), "--out", out, "--resume"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert latest_checkpoint(ckpts).endswith(f"step_{done + 2}")


def test_fsdp_flag_trains_the_same_curve(tmp_path):
    # AdamW, warm-up and gradient clipping through moepar.fully_shard (FSDP2) at ep=2, dp=2.
    common = TINY + ["--steps", "4", "--lr", "1e-2", "--warmup", "2"]
    single = _train(common + ["--out", str(tmp_path / "single")])
    for losses in run_ranks(_train, 2, common + ["--ep", "2", "--fsdp", "--out", str(tmp_path / "fsdp")]):
        assert max(abs(a - b) for a, b in zip(losses, single)) <= 1e-4, (losses, single)
