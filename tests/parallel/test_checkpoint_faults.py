"""Checkpoints under faults: a save interrupted at any point leaves the previous checkpoint
the newest complete one; damaged or foreign checkpoints fail with one clear error naming the
file and the problem, before anything is loaded; RNG streams come back with the state."""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

import moepar
from moepar import checkpoint
from moepar.checkpoint import CheckpointError

from ..helpers.multiproc import run_ranks


def _model(experts: int = 4, hidden: int = 8, state=None):
    state = state or moepar.get_parallel_state()
    return moepar.MoE(hidden, experts, state.ep_size, k=2, ffn_hidden=16, state=state, init_seed=7)


def _trained(experts: int = 4, hidden: int = 8, state=None):
    model = _model(experts, hidden, state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    y = model(torch.randn(6, hidden, generator=torch.Generator().manual_seed(0)))
    (y.square().mean() + moepar.aux_loss(model)).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (BaseException: no cleanup catches it)."""


def _kill(*args, **kwargs):
    raise _Killed()


@pytest.mark.parametrize("point", ["before-any-shard", "after-shards-before-metadata", "before-rename"])
def test_a_save_killed_at_any_point_leaves_the_previous_checkpoint_newest(tmp_path, monkeypatch, point):
    """A SIGKILL is stood in for by raising at the point (what is left on disk is what
    matters): before any shard is written, after the shards but before DCP's .metadata, and
    after everything but before the commit (rename). The previous checkpoint must stay the
    newest and load whole. A guard on the existing atomic save (temporary directory +
    rename); checked to fail (all three points) with the temporary directory dropped, i.e.
    the save written into ``step_2`` itself."""
    root = str(tmp_path / "ckpt")
    model, opt = _trained()
    checkpoint.save_checkpoint(root, 1, model, opt)
    at_step_1 = _params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if point == "before-any-shard":
        monkeypatch.setattr(checkpoint, "save", _kill)
    elif point == "after-shards-before-metadata":
        monkeypatch.setattr(dcp.FileSystemWriter, "finish", _kill)
    else:
        monkeypatch.setattr(checkpoint.os, "replace", _kill)
    with pytest.raises(BaseException, match="_Killed|^$"):   # DCP wraps what its steps raise
        checkpoint.save_checkpoint(root, 2, model, opt)
    monkeypatch.undo()
    assert checkpoint.latest_checkpoint(root).endswith("step_1")
    fresh, fresh_opt = _trained()
    assert checkpoint.load(checkpoint.latest_checkpoint(root), fresh, fresh_opt, extra_keys=("step",)) == {"step": 1}
    for key, value in _params(fresh).items():
        assert torch.equal(value, at_step_1[key]), key


def _damage(path: str, how: str) -> str:
    """Damage checkpoint ``path`` in one way; returns what the error must mention."""
    shard = os.path.join(path, "__0_0.distcp")
    if how == "truncated-shard":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
        return r"__0_0\.distcp: truncated shard, \d+ bytes where the metadata needs \d+"
    if how == "missing-shard":
        os.remove(shard)
        return r"__0_0\.distcp: missing shard"
    if how == "truncated-metadata":
        meta = os.path.join(path, ".metadata")
        with open(meta, "r+b") as f:
            f.truncate(os.path.getsize(meta) // 3)
        return r"\.metadata: unreadable .*truncated"
    if how == "missing-metadata":
        os.remove(os.path.join(path, ".metadata"))
        return r"\.metadata: missing, so .* is not a complete checkpoint"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated-shard", "missing-shard", "truncated-metadata", "missing-metadata"])
def test_damaged_checkpoints_fail_clearly_before_loading_anything(tmp_path, how):
    """Checked to fail without the fix (no ``_check`` in load): DCP raises its own errors,
    no CheckpointError: a truncated shard gives "PytorchStreamReader failed reading zip
    archive" naming no file, a missing or truncated .metadata an AssertionError "metadata is
    None", a missing shard a FileNotFoundError wrapped in a CheckpointException."""
    path = str(tmp_path / "ckpt")
    model, opt = _trained()
    checkpoint.save(path, model, opt)
    pattern = _damage(path, how)
    fresh, fresh_opt = _trained()
    before = _params(fresh)
    with pytest.raises(CheckpointError, match=pattern) as info:
        checkpoint.load(path, fresh, fresh_opt)
    assert path in str(info.value)
    for key, value in _params(fresh).items():    # nothing was loaded
        assert torch.equal(value, before[key]), key


def test_a_checkpoint_of_another_model_fails_clearly(tmp_path):
    """Checked to fail without the fix: DCP raises its own "Size mismatch between saved
    torch.Size([4, 8, 16]) and current ..." (inside a CheckpointException, naming no file)."""
    path = str(tmp_path / "ckpt")
    model, opt = _trained(experts=4)
    checkpoint.save(path, model, opt)
    other, other_opt = _trained(experts=8)
    before = _params(other)
    with pytest.raises(CheckpointError, match=r"global shape \[4, .*\] in the checkpoint .* but \[8, .*\] in "
                                              r"this model .*another model configuration"):
        checkpoint.load(path, other, other_opt)
    assert all(torch.equal(v, before[k]) for k, v in _params(other).items())
    wider, _ = _trained(hidden=16)
    with pytest.raises(CheckpointError, match="another model configuration"):
        checkpoint.load(path, wider)
    with pytest.raises(CheckpointError, match=r"has no extra value \['metrics'\]"):
        checkpoint.load(path, _model(), extra_keys=("metrics",))
    linear = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(CheckpointError, match="a checkpoint of another model"):
        checkpoint.load(path, linear)


def test_a_layout_whose_shards_do_not_cover_a_tensor_fails_clearly(tmp_path, monkeypatch):
    """A checkpoint whose saved shards leave part of a tensor out (what a foreign writer,
    or a layout the loader cannot map, leaves) is refused, naming the entry. Checked to fail
    without the fix: DCP loads it without a word (only the covered half is read)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    path = str(tmp_path / "ckpt")
    model, opt = _trained()
    checkpoint.save(path, model, opt)
    reader = dcp.FileSystemReader(path)
    md = reader.read_metadata()
    key = next(k for k in md.state_dict_metadata if k.startswith("model.") and "experts" in k)
    entry = md.state_dict_metadata[key]
    half = torch.Size([entry.size[0] // 2] + list(entry.size[1:]))
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * len(half)), sizes=half)]
    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", lambda self: md)
    with pytest.raises(CheckpointError, match=rf"the shards of {key} \(saved at world1.tp1.ep1.etp1\) hold "
                                              rf"\d+ of its \d+ elements, so it cannot be resharded"):
        checkpoint.load(path, _model())


def test_rng_streams_come_back_with_the_checkpoint(tmp_path):
    """torch's, Python's and the model-parallel tracker's streams continue after a load as
    they did after the save. Checked to fail with the RNG entry left out of ``save``."""
    path = str(tmp_path / "ckpt")
    model = _model()
    state = moepar.ParallelState.single()
    with state.fork_model_parallel_rng():   # the model-parallel stream, advanced once
        torch.rand(1)
    checkpoint.save(path, model, state=state)
    expected = (torch.rand(3), random.random())
    with state.fork_model_parallel_rng():
        expected_mp = torch.rand(2)
    torch.manual_seed(999)
    random.seed(999)
    checkpoint.load(path, model, state=state, rng=True)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    with state.fork_model_parallel_rng():
        assert torch.equal(torch.rand(2), expected_mp)


def _rng_per_rank(path):
    state = moepar.init_parallel(expert_parallel_size=2, verbose=False)
    torch.manual_seed(100 + state.rank)          # a different stream on each rank
    model = _model(state=state)
    checkpoint.save(path, model)
    expected = torch.rand(4)
    torch.manual_seed(0)
    checkpoint.load(path, model, rng=True)
    return torch.equal(torch.rand(4), expected), expected


def test_each_rank_gets_its_own_rng_streams_back(tmp_path):
    """Two ranks with different streams: each gets its own back (not rank 0's, which is
    what one shared key would give after DCP's deduplication). Checked to fail with the
    rank left out of the entry's name: rank 1 then draws rank 0's numbers."""
    (ok0, drawn0), (ok1, drawn1) = run_ranks(_rng_per_rank, 2, str(tmp_path / "ckpt"))
    assert ok0 and ok1 and not torch.equal(drawn0, drawn1)
