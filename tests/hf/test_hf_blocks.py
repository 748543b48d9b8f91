"""transformers' own MoE blocks vs their moepar conversion (moepar.hf): output,
input gradient and every weight gradient within 1e-5 in fp32, in one process and on 4 gloo
ranks; the way back (HF state dict) exactly; bad input a ValueError naming the problem."""
import pytest

from ..helpers import hf_cases
from ..helpers.multiproc import run_ranks

# The suite's setup installs the hf extra: a missing transformers is a setup error that must
# fail here, not a skip that hides these tests.
hf_cases.import_transformers()
ATOL = 1e-5


def _assert_close(results, where=""):
    """Output and dx within ATOL; a weight gradient within ATOL x max(1, its largest entry)
    (GPT-OSS's down_proj gradients reach ~50: fp32 sums of its clamped activations)."""
    for family, r in results.items():
        tol = {k: ATOL * max(1.0, r.get("gscale:" + k[5:], 1.0)) for k in r}
        bad = {k: v for k, v in r.items() if not k.endswith("scale") and not k.startswith("gscale:")
               and not v <= tol[k]}
        assert not bad, (where, family, bad)
        assert r["roundtrip"] == 0.0 and r["keys_differ"] == 0.0, (where, family)


@pytest.mark.parametrize("family", hf_cases.FAMILIES)
def test_block_matches_transformers(family):
    _assert_close({family: hf_cases.compare(family)})


@pytest.mark.parametrize("world,tp,ep,etp", [(4, 2, 2, 1), (4, 1, 4, 1)])
def test_block_matches_transformers_on_4_ranks(world, tp, ep, etp):
    # tp2*ep2 (shared experts TP-sliced, each TP rank dispatching half of the routes) and
    # ep4 (one expert per rank for the 4-expert families); every family in one call.
    per_rank = run_ranks(hf_cases.compare_layout, world, tp, ep, etp, hf_cases.FAMILIES)
    for rank, results in enumerate(per_rank):
        _assert_close(results, f"rank {rank} tp={tp} ep={ep} etp={etp}")


def test_misshapen_tensor_raises_on_every_rank():
    errors = run_ranks(hf_cases.bad_checkpoint_error, 4, 2, 2)
    assert all("experts.down_proj" in e and "misshapen" in e for e in errors), errors
    assert len(set(errors)) == 1, errors


def test_bad_input_names_the_problem():
    from moepar.hf import check_source, convert_block
    from moepar.hf.convert import DictSource
    tr = hf_cases.import_transformers()
    cfg, blk = hf_cases.block("mixtral")
    with pytest.raises(ValueError, match="model_type='bert'"):
        convert_block(blk, tr.BertConfig())
    prelu = hf_cases.config("mixtral")
    prelu.hidden_act = "prelu"   # an activation with learnable parameters
    with pytest.raises(ValueError, match="hidden_act='prelu'"):
        convert_block(blk, prelu)
    v3 = hf_cases.config("deepseek_v3")   # k=5 > topk_group 2 x 2 experts per group
    v3.num_experts_per_tok = 5
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds the 4 experts"):
        convert_block(None, v3)
    v2 = hf_cases.config("deepseek_v2")
    v2.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method='noaux_tc'"):
        convert_block(None, v2, safetensors=None)
    sd = dict(blk.state_dict())
    del sd["experts.down_proj"]
    with pytest.raises(ValueError, match=r"missing tensors \['experts.down_proj'\]"):
        check_source(DictSource(sd), cfg)
    _, other = hf_cases.block("olmoe")
    with pytest.raises(ValueError, match="OlmoeSparseMoeBlock"):
        convert_block(other, cfg)
