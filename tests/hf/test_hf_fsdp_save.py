"""The way back under FSDP2: ``moepar.hf.save_hf_checkpoint`` of a swapped model that
``moepar.fully_shard`` sharded gathers every sharded parameter (dense ones over DP, experts
over EDP, then over EP / TP) and writes the checkpoint it writes without FSDP2, which is
transformers' own state dict, exactly."""
import os

import torch

from ..helpers import hf_cases
from ..helpers.multiproc import run_ranks

hf_cases.import_transformers()

# a shared expert with its gate (fused_chunk), expert biases (interleaved), per-expert keys
FAMILIES = ["qwen2_moe", "gpt_oss", "switch_transformers"]


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def fsdp_save_worker(tp: int, ep: int, families: list[str], path: str) -> dict:
    """Per family on this rank: (the state dict ``save_hf_checkpoint`` returned under FSDP2
    equals the one without FSDP2, which equals transformers' own; the file rank 0 wrote
    equals it too; some expert tensor was sharded by FSDP2 on this rank)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    import moepar
    from moepar.hf import hf_model_state_dict, replace_moe_blocks, save_hf_checkpoint
    state = moepar.init_parallel(tp, ep, verbose=False)
    out = {}
    for family in families:
        model = hf_cases.model(family)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        replace_moe_blocks(model, state)
        plain = hf_model_state_dict(model)   # the checkpoint without FSDP2
        moepar.fully_shard(model, state)
        sharded = any(hasattr(p, "device_mesh") and p.to_local().shape != p.shape
                      for n, p in model.named_parameters() if ".experts." in n)
        inputs = {k: v[state.dp_rank:state.dp_rank + 1]
                  for k, v in hf_cases.model_inputs(family, batch=state.dp_size).items()}
        model(**inputs).loss.backward()   # saved after a step's backward, as training would
        where = os.path.join(path, family)
        got = save_hf_checkpoint(model, where)
        dist.barrier()   # rank 0's file is written
        on_disk = load_file(os.path.join(where, "model.safetensors"))
        out[family] = (_equal(got, plain), _equal(plain, want), _equal(on_disk, want), sharded)
    return out


def test_save_hf_checkpoint_under_fsdp2_equals_the_one_without(tmp_path):
    # tp1 x ep2 on 2 ranks (dense sharded over dp 2, one expert-data replica), every layout,
    # and on 4 ranks (dp 4: the experts sharded over edp 2 as well), one family
    for world, families in ((2, FAMILIES), (4, FAMILIES[:1])):
        path = str(tmp_path / f"world{world}")
        for rank, per_family in enumerate(run_ranks(fsdp_save_worker, world, 1, 2, families, path)):
            for family, (got_ok, plain_ok, disk_ok, sharded) in per_family.items():
                assert got_ok and plain_ok and disk_ok, (world, rank, family, got_ok, plain_ok, disk_ok)
                assert sharded == (world == 4), (world, rank, family, sharded)
