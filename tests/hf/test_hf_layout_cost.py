"""transformers' layouts cost no copy: a swapped block's forward + backward runs no more copy
ops (copy_, cat, stack, clone) than the same layer in moepar's own layout, per layout and
GEMM path, and its gradients are the same. (The timing: ``python -m moepar.hf.bench``,
figures in docs/benchmarks.md.)"""
import pytest
import torch

from ..helpers import hf_cases

hf_cases.import_transformers()

COPIES = ("aten::copy_", "aten::cat", "aten::stack", "aten::clone")
# one family per layout: fused_chunk, chunk_in_out, interleaved, per_expert
LAYOUTS = ["mixtral", "llama4_text", "gpt_oss", "switch_transformers"]


def _copies(step) -> int:
    from torch.profiler import ProfilerActivity, profile
    step()   # warm: buffers, lazily built tables
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.count for e in prof.key_averages() if e.key in COPIES)


@pytest.mark.parametrize("path", ["loop", "bmm"])
@pytest.mark.parametrize("family", LAYOUTS)
def test_hf_layout_adds_no_copy(family, path):
    from moepar.hf import hf_state_dict
    from moepar.hf.bench import pair, step_fn
    from moepar.hf.families import family_of, write_experts
    ours, hf = pair(family, hidden=32, ffn=48, experts=4)
    ours.experts.gemm_path = hf.moe.experts.gemm_path = path
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(1, 40, 32, generator=gen), torch.randn(1, 40, 32, generator=gen)
    n_ours, n_hf = _copies(step_fn(ours, x, g)), _copies(step_fn(hf, x, g))
    assert n_hf <= n_ours, (family, path, n_hf, n_ours)
    # and the gradients written in transformers' layout are the moepar layout's, rewritten
    ex = ours.experts
    want = write_experts(family_of(hf.hf_config),
                         {n: getattr(ex, n).grad for n in ("w1", "w2", "w3", "b1", "b2", "b3")
                          if getattr(ex, n, None) is not None})
    got = hf_state_dict(hf.moe, hf.hf_config, grads=True)
    assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-6, (family, path)
