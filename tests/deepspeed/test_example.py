"""The example GPT-MoE under ``--deepspeed CONFIG.json`` trains to the same losses as without it."""
import json

import pytest

from examples import train_gpt_moe

from ..helpers.multiproc import run_ranks
from .net import quiet_deepspeed

pytest.importorskip("deepspeed")

TINY = ["--layers", "2", "--hidden", "16", "--heads", "2", "--context", "16", "--experts", "4", "--topk", "2",
        "--expert-ffn", "32", "--dense-ffn", "32", "--batch-size", "8", "--eval-interval", "1000",
        "--eval-batches", "1", "--sample-tokens", "0", "--quiet", "--log-interval", "1000", "--hardware", "h100"]


def _losses(argv):
    quiet_deepspeed()
    return train_gpt_moe.train(train_gpt_moe.parse_args(argv))["losses"]


def test_example_trains_the_same_losses_under_deepspeed(tmp_path):
    # 30 steps at tp2·ep2, 2 micro-batches a step (DeepSpeed's gradient accumulation), AdamW
    # with the example's warm-up and cosine schedule and clipping; ZeRO-2 from the file.
    config = tmp_path / "zero2.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    common = TINY + ["--steps", "30", "--tp", "2", "--ep", "2", "--microbatches", "2", "--lr", "1e-2"]
    plain = run_ranks(_losses, 4, common + ["--out", str(tmp_path / "plain")])
    engine = run_ranks(_losses, 4, common + ["--out", str(tmp_path / "ds"), "--deepspeed", str(config)])
    for rank, (a, b) in enumerate(zip(plain, engine)):
        assert len(a) == len(b) == 30 and a[-1] < a[0]
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5, (rank, a, b)


def test_example_refuses_what_the_flag_cannot_take(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}, "train_batch_size": 64}))
    with pytest.raises(ValueError, match="--fsdp"):
        train_gpt_moe.deepspeed_glue.check_args(train_gpt_moe.parse_args(TINY + ["--fsdp", "--deepspeed", str(config)]))
    args = train_gpt_moe.parse_args(TINY + ["--deepspeed", str(config)])
    with pytest.raises(ValueError, match="train_batch_size=64.*8"):
        train_gpt_moe.deepspeed_glue.config(args, dp=1)


def _hf_log(argv):
    import contextlib
    import io

    from examples import finetune_hf_moe
    quiet_deepspeed()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert finetune_hf_moe.main(argv) == 0
    return [line.split("(")[0].split() for line in printed.getvalue().splitlines() if line.startswith("step ")]


def test_hf_finetune_example_under_zero2_with_swapped_blocks(tmp_path):
    # A Qwen3-MoE causal LM built from a config, its MoE blocks swapped for moepar's as it is
    # loaded (tp2·ep2 on 4 ranks), fine-tuned 4 AdamW steps by DeepSpeed's ZeRO-2 engine: the
    # printed losses are the plain loop's.
    from examples import finetune_hf_moe
    common = ["--steps", "4", "--hidden", "32", "--experts", "4", "--seq", "16", "--batch", "4", "--log-every", "1",
              "--no-save", "--tp", "2", "--ep", "2", "--init", str(tmp_path / "init")]
    finetune_hf_moe.build_initial(finetune_hf_moe.parse_args(["--out", str(tmp_path)] + common), str(tmp_path / "init"))
    config = tmp_path / "zero2.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    plain = run_ranks(_hf_log, 4, ["--out", str(tmp_path / "plain")] + common)[0]
    engine = run_ranks(_hf_log, 4, ["--out", str(tmp_path / "ds"), "--deepspeed", str(config)] + common)[0]
    assert len(plain) == 4 and engine == plain, (plain, engine)
