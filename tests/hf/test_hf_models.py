"""Whole HF causal LMs with their MoE blocks replaced (moepar.hf): same logits and
input-embedding gradients; the HF checkpoint written back loads in transformers with the
same logits; a sharded safetensors checkpoint read lazily, each rank only its experts."""
import os

import pytest
import torch

from ..helpers import hf_cases
from ..helpers.multiproc import run_ranks

# The suite's setup installs the hf extra: a missing transformers or safetensors is a setup
# error that must fail here, not a skip that hides these tests.
import safetensors  # noqa: E402,F401

hf_cases.import_transformers()

MODELS = ["mixtral", "qwen3_moe", "deepseek_v3"]


def _model(family: str, seed: int = 0):
    return hf_cases.model(family, seed, num_hidden_layers=2)


def _logits_and_grad(model, ids):
    model.zero_grad()
    out = model(input_ids=ids)
    (out.logits * torch.linspace(-1, 1, out.logits.shape[-1])).sum().backward()
    return out.logits.detach(), model.get_input_embeddings().weight.grad.clone()


@pytest.mark.parametrize("family", MODELS)
def test_causal_lm_same_logits_and_embedding_grads(family, tmp_path):
    from moepar.hf import replace_moe_blocks, save_hf_checkpoint
    model = _model(family)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    logits_ref, grad_ref = _logits_and_grad(model, ids)
    assert replace_moe_blocks(model) == 2
    logits, grad = _logits_and_grad(model, ids)
    assert float((logits - logits_ref).abs().max()) <= 1e-5
    assert float((grad - grad_ref).abs().max()) <= 1e-5
    # the way back: an HF checkpoint transformers loads, with the same logits
    save_hf_checkpoint(model, str(tmp_path))
    tr = hf_cases.import_transformers()
    back = tr.AutoModelForCausalLM.from_pretrained(str(tmp_path)).float().eval()
    with torch.no_grad():
        assert float((back(input_ids=ids).logits - logits_ref).abs().max()) <= 1e-5


def test_sharded_checkpoint_each_rank_reads_only_its_experts(tmp_path):
    model = _model("qwen3_moe")
    model.save_pretrained(str(tmp_path), max_shard_size="10KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    for n, logits, reads, ep_rank in run_ranks(hf_cases.sharded_worker, 2, str(tmp_path), ids):
        assert n == 2
        assert float((logits - ref).abs().max()) <= 1e-5
        # 4 experts, 2 per rank: only this rank's experts are read, as per-expert tensors
        # (the Hub layout transformers saves: experts.{e}.gate_proj.weight ...) or rows lo..hi
        lo = 2 * ep_rank
        assert reads, reads
        for key, rows in reads:
            e = key.split(".experts.")[1].split(".")[0]
            assert (int(e) in (lo, lo + 1)) if e.isdigit() else rows == (lo, lo + 2), (key, rows)


def test_finetune_example_runs_and_reloads(tmp_path, capsys):
    # One process, a few steps of a tiny model: the script's whole path (build, lazy load,
    # train, save back, reload with transformers, generate) runs and the reload agrees.
    from examples import finetune_hf_moe
    assert finetune_hf_moe.main(["--out", str(tmp_path), "--steps", "3", "--hidden", "32", "--experts", "4",
                                 "--seq", "16", "--batch", "2", "--log-every", "1"]) == 0
    out = capsys.readouterr().out
    assert "step    2  loss" in out and "generated: " in out
    diff = float(out.split("max |logits - moepar's| = ")[1].split()[0])
    assert diff <= 1e-5, out
