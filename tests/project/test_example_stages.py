"""The example's stage builder (``GPT(cfg, stage=(index, num_stages))``) and the pipeline
helpers refuse a stage that does not exist by name, in one process, before anything is built:
out of range it built layers the model does not have (``stage=(2, 2)``: blocks 4 and 5 of
4), and the run died later in a raw gloo abort."""
import pytest
import torch

from examples.gpt_moe import GPT, GPTConfig
from moepar.parallel import pipeline

CFG = GPTConfig(layers=4, hidden=16, heads=2, context=8, experts=4, expert_ffn=16, dense_ffn=16)


@pytest.mark.parametrize("stage", [(2, 2), (-1, 2), (4, 4)])
def test_stage_index_outside_its_range_is_refused(stage):
    with pytest.raises(ValueError, match=rf"stage={stage[0]} must be an integer in \[0, {stage[1]}\)"):
        GPT(CFG, stage=stage)


@pytest.mark.parametrize("num_stages", [0, -2])
def test_fewer_than_one_stage_is_refused(num_stages):
    with pytest.raises(ValueError, match=rf"num_stages={num_stages} must be a positive integer"):
        GPT(CFG, stage=(0, num_stages))


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="num_stages=8 is more than the 4 layers: every stage needs at least one"):
        GPT(CFG, stage=(0, 8))
    with pytest.raises(ValueError, match="layers=4 is not divisible by the 3 pipeline stages"):
        GPT(CFG, stage=(0, 3))


@pytest.mark.parametrize("stage,match", [((1.0, 2), r"stage=1\.0 must be an integer"),
                                         ((True, 2), "stage=True must be an integer"),
                                         (("0", 2), "stage='0' must be an integer"),
                                         ((0, 2.0), r"num_stages=2\.0 must be a positive integer"),
                                         ((0,), r"stage=\(0,\) must be a pair \(index, num_stages\)"),
                                         (1, r"stage=1 must be a pair")])
def test_a_stage_that_is_not_two_integers_is_refused(stage, match):
    with pytest.raises(ValueError, match=match):
        GPT(CFG, stage=stage)


def test_valid_stages_still_cover_the_model_once():
    names = [set(GPT(CFG, stage=(i, 2)).blocks.keys()) for i in range(2)]
    assert names == [{"0", "1"}, {"2", "3"}]


def test_cut_blocks_refuses_a_negative_stage():
    # a negative stage indexed the list from its end: stage -1 of 2 was silently the last one
    blocks = [torch.nn.Linear(2, 2) for _ in range(4)]
    with pytest.raises(ValueError, match=r"stage=-1 must be an integer in \[0, 2\)"):
        pipeline.cut_blocks(blocks, -1, 2)
    assert pipeline.cut_blocks(blocks, 1, 2).pipeline_stage == (1, 2)


def test_pipeline_refuses_a_module_built_for_another_stage():
    # one process (pp 1: one stage); the module was built as stage 1 of 2
    chunk = GPT(CFG, stage=(1, 2))
    x, y = chunk.stage_shapes(1)
    with pytest.raises(ValueError, match="stage module 0 was built as stage 1 of 2, but pipeline rank 0 runs "
                                         "stage 0 of 1"):
        pipeline.Pipeline([chunk], "gpipe", 1, chunk.loss, [x], [y])
