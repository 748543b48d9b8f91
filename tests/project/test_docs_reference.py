"""The 20-line reference MoE that docs/moe.md shows first computes what ``moepar.MoE`` does:
the block is read from the page and run against the layer (one process, dropless, GELU)."""
import os
import re

import torch

import moepar
from moepar.parallel.groups import ParallelState

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "moe.md")


def _reference_from_docs():
    text = open(PAGE).read()
    section = text.split("## What the layer computes, in 20 lines", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    scope: dict = {}
    exec(compile(code, PAGE, "exec"), scope)
    return scope["reference_moe"]


def test_the_docs_reference_moe_equals_the_layer():
    reference_moe = _reference_from_docs()
    moe = moepar.MoE(16, 6, 1, state=ParallelState.single(), ffn_hidden=24, k=2, init_seed=11, aux_loss_coeff=1.0)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
    y = moe(x)
    ex = moe.experts
    y_ref, aux_ref = reference_moe(x, moe.router.weight.detach(), ex.w1.detach(), ex.w2.detach(), 2)
    torch.testing.assert_close(y.detach(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe.aux_loss.detach(), aux_ref, atol=1e-6, rtol=1e-6)
