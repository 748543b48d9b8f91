"""Any ``torch.optim`` optimizer's state survives a checkpoint: the loaded state equals the
saved one key for key (dtype and device included), and the next step equals the
uninterrupted run's. Checked to fail without the fix: loading created Adam's keys only, so
SGD with momentum was refused (CheckpointError: no entry for ``exp_avg``) and AMSGrad's
``max_exp_avg_sq`` was never loaded (its next step raised KeyError)."""
from __future__ import annotations

import pytest
import torch

import moepar
from moepar import checkpoint
from moepar.checkpoint import CheckpointError

from ..helpers.multiproc import run_ranks

OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov-two-groups": lambda ps: torch.optim.SGD(
        [{"params": ps[:2], "lr": 0.05}, {"params": ps[2:]}], lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw-tensor-lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), foreach=False),
    "rmsprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
}


def _model(seed):
    return moepar.MoE(8, 4, 1, k=2, ffn_hidden=16, bias=True, init_seed=seed)


def _step(model, opt, i):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(i))
    opt.zero_grad()
    (model(x).square().mean() + moepar.aux_loss(model)).backward()
    opt.step()


def _same_state(a, b, params_a, params_b):
    for pa, pb in zip(params_a, params_b):
        sa, sb = a.state[pa], b.state[pb]
        assert sa.keys() == sb.keys(), (sa.keys(), sb.keys())
        for key, va in sa.items():
            vb = sb[key]
            if torch.is_tensor(va):
                assert (va.dtype, va.device, va.shape) == (vb.dtype, vb.device, vb.shape), key
                assert torch.equal(va, vb), key
            else:
                assert va == vb, key


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_any_optimizer_state_round_trips(tmp_path, name):
    make = OPTIMIZERS[name]
    model = _model(1)
    opt = make(list(model.parameters()))
    for i in range(2):
        _step(model, opt, i)
    checkpoint.save(str(tmp_path / "ckpt"), model, opt, rng=False)
    _step(model, opt, 2)                      # the uninterrupted third step
    fresh = _model(99)
    fresh_opt = make(list(fresh.parameters()))
    for g in fresh_opt.param_groups:          # other settings: the checkpoint's must win
        g["weight_decay"] = 0.5
    checkpoint.load(str(tmp_path / "ckpt"), fresh, fresh_opt)
    _step(fresh, fresh_opt, 2)
    _same_state(opt, fresh_opt, list(model.parameters()), list(fresh.parameters()))
    for pa, pb in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(pa, pb)
    for ga, gb in zip(opt.param_groups, fresh_opt.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"}.keys() == {k for k in gb if k != "params"}
        assert all(str(ga[k]) == str(gb[k]) for k in ga if k != "params"), (ga, gb)


def test_a_parameter_saved_without_state_loads_without_state(tmp_path):
    """A parameter that never had a gradient has no state when saved, and none after the
    load (not a refusal, and not a made-up state)."""
    model = _model(1)
    frozen = model.router.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(6, 8)
    (model(x).square().mean()).backward()
    frozen.grad = None
    opt.step()
    checkpoint.save(str(tmp_path / "ckpt"), model, opt)
    fresh = _model(99)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    checkpoint.load(str(tmp_path / "ckpt"), fresh, fresh_opt)
    assert not fresh_opt.state.get(fresh.router.weight)
    assert all(fresh_opt.state[p] for p in fresh.parameters() if p is not fresh.router.weight)


def test_another_optimizer_or_grouping_is_refused_and_changes_nothing(tmp_path):
    """A checkpoint of SGD into Adam, and parameters regrouped across saved groups of
    different settings: each a CheckpointError naming it, and the optimizer keeps its groups
    and gets no state. The saved settings otherwise win (torch's ``load_state_dict`` too):
    Adam's state loads into an AMSGrad Adam as plain Adam."""
    path = str(tmp_path / "ckpt")
    model = _model(1)
    params = list(model.parameters())
    sgd = torch.optim.SGD([{"params": params[:1], "lr": 0.5}, {"params": params[1:]}], lr=1e-2, momentum=0.9)
    _step(model, sgd, 0)
    checkpoint.save(path, model, sgd)
    fresh = _model(99)
    adam = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    before = [dict(g) for g in adam.param_groups]
    with pytest.raises(CheckpointError, match=r"its optimizer state is a SGD's, this optimizer is a Adam"):
        checkpoint.load(path, fresh, adam)
    assert not adam.state and adam.param_groups == before
    one_group = torch.optim.SGD(fresh.parameters(), lr=1e-2, momentum=0.9)
    with pytest.raises(CheckpointError, match=r"param group 0 of this SGD holds router\.weight and experts\.w1, "
                                              r"saved in groups with different \['lr'\]"):
        checkpoint.load(path, fresh, one_group)
    assert not one_group.state and one_group.param_groups[0]["lr"] == 1e-2
    _step(model, adam_saved := torch.optim.Adam(model.parameters(), lr=1e-2), 1)
    checkpoint.save(path, model, adam_saved)
    amsgrad = torch.optim.Adam(fresh.parameters(), lr=1e-2, amsgrad=True)
    checkpoint.load(path, fresh, amsgrad)
    assert amsgrad.param_groups[0]["amsgrad"] is False and "max_exp_avg_sq" not in amsgrad.state[fresh.router.weight]


def _on_the_device(path):
    """Adam with ``capturable`` and ``fused`` on (fake) CUDA parameters: where the loaded
    ``step`` lives, and whether the next step equals the uninterrupted one's."""
    from tests.helpers import fake_cuda
    torch.cuda.nccl.version = lambda: (2, 0, 0)   # DCP's logger asks; the shim has no NCCL
    out = {}
    with fake_cuda.session(strict=False):
        for flag in ("capturable", "fused"):
            torch.manual_seed(0)
            model = fake_cuda.to_cuda(torch.nn.Linear(4, 3))
            fresh = fake_cuda.to_cuda(torch.nn.Linear(4, 3))
            opt, fresh_opt = (torch.optim.Adam(m.parameters(), lr=1e-2, **{flag: True}) for m in (model, fresh))
            x = fake_cuda.to_cuda(torch.randn(2, 4))
            model(x).square().sum().backward()
            opt.step()
            checkpoint.save(f"{path}/{flag}", model, opt)
            checkpoint.load(f"{path}/{flag}", fresh, fresh_opt)
            steps = [str(o.state[m.weight]["step"].device) for o, m in ((opt, model), (fresh_opt, fresh))]
            for m, o in ((model, opt), (fresh, fresh_opt)):
                o.zero_grad()
                m(x).square().sum().backward()
                o.step()
            out[flag] = steps, torch.equal(fake_cuda.to_cpu(model.weight.detach()), fake_cuda.to_cpu(fresh.weight.detach()))
    return out


def test_fused_and_capturable_adam_get_step_on_the_device(tmp_path):
    """Checked to fail without the fix: the loaded ``step`` was created on the CPU (cpu where
    the saving optimizer had cuda:0), which capturable and fused Adam refuse at the next step."""
    (out,) = run_ranks(_on_the_device, 1, str(tmp_path), fake_cuda=True)
    assert out == {"capturable": (["cuda:0", "cuda:0"], True), "fused": (["cuda:0", "cuda:0"], True)}, out


def _factored(path, tp, load):
    """Adafactor (row and column statistics: shapes other than the parameter's) on a
    TP-sliced linear: saved at tp2, loaded at ``tp``."""
    from moepar.parallel import ColumnParallelLinear, init_parallel
    state = init_parallel(tp, 1, verbose=False)
    model = ColumnParallelLinear(6, 4, gather_output=True, init_seed=1 if not load else 9, state=state)
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    if not load:
        model(torch.randn(3, 6, generator=torch.Generator().manual_seed(0))).square().sum().backward()
        opt.step()
        checkpoint.save(path, model, opt)
        return {k: v.clone() for k, v in opt.state[model.weight].items()}
    try:
        checkpoint.load(path, model, opt)
    except CheckpointError as e:
        return str(e)
    return {k: v.clone() for k, v in opt.state[model.weight].items()}


def test_factored_state_of_a_sliced_parameter_is_saved_per_rank(tmp_path):
    """Adafactor's row_var/col_var of a TP-sliced weight differ from rank to rank: each rank
    gets its own back at the same layout, and another layout is refused by name (they
    cannot be resharded). Checked to fail without the fix: the load was refused (it created
    Adam's keys); and the save wrote each statistic as one replicated entry, which DCP keeps
    from one rank only."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_factored, 2, path, 2, False)
    assert not torch.equal(saved[0]["col_var"], saved[1]["col_var"])
    for mine, got in zip(saved, run_ranks(_factored, 2, path, 2, True)):
        assert got.keys() == mine.keys() and all(torch.equal(got[k], mine[k]) for k in mine)
    for got in run_ranks(_factored, 2, path, 1, True):
        assert "has no optim.weight.row_var@world2.tp1.ep1.etp1.rank" in got and "saved per rank and loads only " \
            "in the layout it was saved at (world2.tp2.ep1.etp1), not at world2.tp1.ep1.etp1" in got, got
