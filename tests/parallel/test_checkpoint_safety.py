"""Loading a checkpoint runs no code: crafted ``.metadata`` and crafted entries are refused
by name (a marker file the crafted pickle would create is never created), also through the
example's ``--resume auto``; extras are plain data, checked when saved; checkpoints written
before this format still load (tests/data/checkpoint_v0, see its README)."""
from __future__ import annotations

import io
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import moepar
from moepar import checkpoint
from moepar.checkpoint import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEGACY = os.path.join(ROOT, "tests", "data", "checkpoint_v0")


class _Marker:
    """Unpickling it creates ``path`` (what a crafted checkpoint's payload would do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _model(seed=7, **kw):
    return moepar.MoE(8, 4, 1, k=2, ffn_hidden=16, init_seed=seed, **kw)


def _saved(path, extra=None):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).square().mean().backward()
    opt.step()
    checkpoint.save(path, model, opt, extra=extra)
    return model, opt


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("how", ["whole-file", "inside-real-metadata"])
def test_a_crafted_metadata_file_runs_no_code(tmp_path, how):
    """Checked to fail without the fix: DCP's ``FileSystemReader.read_metadata`` is a plain
    ``pickle.load``, so the marker was created (and then, for the whole file, a
    CheckpointError "unreadable" raised after the fact)."""
    path, marker = str(tmp_path / "ckpt"), tmp_path / "marker"
    _saved(path)
    meta = os.path.join(path, ".metadata")
    if how == "whole-file":
        payload = _Marker(marker)
    else:   # a real index with the payload where DCP keeps its planner's data
        payload = dcp.FileSystemReader(path).read_metadata()
        payload.planner_data = _Marker(marker)
    with open(meta, "wb") as f:
        pickle.dump(payload, f)
    fresh = _model(seed=99)
    before = _params(fresh)
    with pytest.raises(CheckpointError, match=r"\.metadata: refused: it names posix\.system, which is not one "
                                              r"of the classes torch\.distributed\.checkpoint's metadata"):
        checkpoint.load(path, fresh)
    assert not marker.exists()
    assert all(torch.equal(v, before[k]) for k, v in _params(fresh).items())


def _write_entry(path, key, blob, model):
    """A checkpoint of ``model`` whose entry ``key`` holds ``blob`` as written (bypassing
    the plain-data check, as a crafted file does)."""
    sd = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    sd[key] = blob
    dcp.save(sd, checkpoint_id=path, no_dist=True)


def _pickled(obj):
    return pickle.dumps(obj)


def _zipped(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@pytest.mark.parametrize("form", ["pickle-bytes", "torch-save-bytes", "object"])
def test_a_crafted_extra_value_runs_no_code(tmp_path, form):
    """Three ways to carry a payload in an entry: an earlier moepar's pickled bytes (which
    moepar unpickled), ``torch.save`` bytes, and the object itself (which DCP's own planner
    reads with ``torch.load(weights_only=False)``). Checked to fail without the fix: the
    first and third created the marker (the first while loading the extra, the third inside
    ``dcp.load``)."""
    path, marker = str(tmp_path / "ckpt"), tmp_path / "marker"
    model = _model()
    blob = {"pickle-bytes": _pickled, "torch-save-bytes": _zipped, "object": lambda o: o}[form](_Marker(marker))
    _write_entry(path, "extra.metrics", blob, model)
    if form == "object":   # the control: DCP's own reader runs it
        dcp.load({"extra.metrics": b""}, checkpoint_id=path, no_dist=True)
        assert marker.exists()
        marker.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: entry extra\.metrics: .*posix\.system"):
        checkpoint.load(path, _model(seed=99), extra_keys=("metrics",))
    assert not marker.exists()


def test_extras_are_plain_data_checked_when_saved(tmp_path):
    """Anything but plain data is refused before anything is written, naming the key (and
    the path inside it) and the type; plain extras round-trip exactly, tuples and tensors
    included."""
    import numpy
    path = str(tmp_path / "ckpt")
    for bad, where in [({"cfg": _Marker("x")}, r"extra\['cfg'\] is a tests\.parallel\.test_checkpoint_safety\._Marker"),
                       ({"m": {"a": [1, numpy.float64(2.0)]}}, r"extra\['m'\]\['a'\]\[1\] is a numpy\.float64"),
                       ({"m": {(1, 2): 3}}, r"extra\['m'\] has a key of type tuple")]:
        with pytest.raises(CheckpointError, match=where):
            _saved(path, extra=bad)
        assert not os.path.exists(os.path.join(path, ".metadata"))
    plain = {"step": 3, "nested": {"a": [1.5, "x", None, True], "t": torch.arange(3), "pair": (1, (2, 3))},
             "raw": b"\x00\x01", "size": torch.Size([2, 3]), "dtype": torch.bfloat16}
    _saved(path, extra=plain)
    back = checkpoint.load(path, _model(seed=99), extra_keys=tuple(plain))
    assert back.keys() == plain.keys() and torch.equal(back["nested"].pop("t"), plain["nested"].pop("t"))
    assert back == plain and isinstance(back["nested"]["pair"], tuple)


def _legacy_copy(tmp_path):
    path = str(tmp_path / "v0")
    shutil.copytree(LEGACY, path)
    return path


def test_a_checkpoint_of_the_earlier_format_loads(tmp_path):
    """tests/data/checkpoint_v0 (written at ep2 with 2 copies by moepar's checkpoint code
    before the plain-data format): parameters, AdamW state and groups, RNG streams (tensors
    and NumPy arrays) and extras holding slot maps load with no opt-in, equal to what DCP's
    own reader finds in the files; an extra holding another class (an argparse.Namespace)
    is refused by name unless ``trust_pickles=True``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = _legacy_copy(tmp_path)
    model = _model(seed=99, expert_bias=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    extra = checkpoint.load(path, model, opt, extra_keys=("step", "metrics"))
    assert extra["step"] == 2 and extra["metrics"]["losses"] == [4.5, 4.25]
    (placement, counted, planned), = extra["metrics"]["replicas"].values()
    assert type(placement).__name__ == "Placement" and placement.ep_size == 2 and sum(counted) > 0
    dcp_to_torch_save(path, str(tmp_path / "flat.pt"))
    files = torch.load(str(tmp_path / "flat.pt"), weights_only=False)   # the fixture is ours: trusted
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), files[f"model.{name}"]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], files[f"optim.{name}.{key}"]), (name, key)
    assert opt.param_groups[0]["lr"] == 1e-2
    with pytest.warns(UserWarning, match=r"no RNG streams saved for this layout and rank"):
        checkpoint.load(path, model, rng=True)   # saved at world2: a warning, no error
    with pytest.raises(CheckpointError, match=r"entry extra\.config: written by an earlier moepar as a pickle "
                                              r"that names argparse\.Namespace.*trust_pickles=True"):
        checkpoint.load(path, model, extra_keys=("config",))
    assert checkpoint.load(path, model, extra_keys=("config",), trust_pickles=True)["config"].lr == 1e-2


def test_moepar_checkpoint_is_reachable_as_the_readme_writes_it():
    """``import moepar; moepar.checkpoint.save(...)`` in a fresh interpreter. Checked to fail
    without the fix: AttributeError (the lazy package did not expose the module)."""
    import subprocess
    import sys
    code = "import moepar; print(moepar.checkpoint.save.__module__, moepar.checkpoint.CheckpointError.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["moepar.checkpoint", "CheckpointError"], out.stderr[-2000:]
