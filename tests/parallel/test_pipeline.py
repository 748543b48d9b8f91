"""Pipeline stages with experts: torch's schedules train the example GPT-MoE exactly as one
process accumulating the same micro-batches does; bad pipelines fail on every rank first."""
import functools

import pytest
import torch

import moepar
from examples.gpt_moe import GPT, GPTConfig
from moepar import checkpoint
from moepar.parallel import pipeline
from moepar.parallel.groups import Layout

from ..helpers.multiproc import run_ranks

CFG = dict(vocab_size=256, context=8, layers=4, hidden=16, heads=2, experts=4, topk=2, expert_ffn=16,
           dense_ffn=16, init_seed=7)
BATCH, MICRO, LR = 8, 2, 0.2


def batch(step: int):
    """The global batch of ``step``: [BATCH, context] tokens and targets."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["context"] + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def local_rows(dp_rank: int, dp: int, micro: int) -> list[int]:
    """This dp rank's rows, micro-batch by micro-batch: its slice of each global micro-batch."""
    per_mb, mine = BATCH // micro, BATCH // micro // dp
    return [m * per_mb + dp_rank * mine + j for m in range(micro) for j in range(mine)]


def _optimizer(model, name):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=LR)


@functools.lru_cache(maxsize=None)
def reference(steps: int, micro: int = MICRO, opt_name: str = "sgd"):
    return single_process(steps, micro, opt_name)


def single_process(steps: int, micro: int = MICRO, opt_name: str = "sgd", resume: str | None = None):
    """pp = 1 in one process, accumulating the same micro-batches."""
    state = moepar.ParallelState.single()
    model = GPT(GPTConfig(**CFG), state)
    opt = _optimizer(model, opt_name)
    losses, start = [], 0
    if resume is not None:
        start = checkpoint.load(resume, model, opt, extra_keys=("step",), state=state)["step"]
    for step in range(start, steps):
        x, y = batch(step)
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            ce = model(xm, ym)
            ((ce + moepar.aux_loss(model)) / micro).backward()
            total += float(ce.detach()) / micro
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _stage_slice(full: torch.Tensor, markers: dict, coords: dict, sizes: dict) -> torch.Tensor:
    """The part of the whole model's ``full`` that a rank holds (EP, ETP and TP slices)."""
    if markers.get("moepar_expert"):
        full = full.chunk(sizes["ep"], 0)[coords["ep"]]
        if markers.get("moepar_expert_partition_dim") is not None:
            full = full.chunk(sizes["etp"], markers["moepar_expert_partition_dim"])[coords["etp"]]
    elif markers.get("tensor_model_parallel"):
        full = full.chunk(sizes["tp"], markers["partition_dim"])[coords["tp"]]
    return full


def _train_flat(tp, ep, steps, resume, opt_name="adamw", micro=MICRO, ckpt=None):
    """pp = 1 on every rank of the world: the same micro-batches, accumulated."""
    state = moepar.init_parallel(tp, ep)
    model = GPT(GPTConfig(**CFG), state)
    opt = _optimizer(model, opt_name)
    start = checkpoint.load(resume, model, opt, extra_keys=("step",), state=state)["step"]
    rows = local_rows(state.dp_rank, state.dp_size, micro)
    losses = []
    for step in range(start, steps):
        x, y = batch(step)
        total = torch.zeros(1)
        for xm, ym in zip(x[rows].chunk(micro), y[rows].chunk(micro)):
            ce = model(xm, ym)
            ((ce + moepar.aux_loss(model)) / micro).backward()
            total += ce.detach() / micro
        moepar.allreduce_gradients(model, state)
        opt.step()
        opt.zero_grad()
        moepar.parallel.comm.all_reduce_(total, state.dp_group)
        losses.append(float(total) / state.dp_size)
    if ckpt is not None:
        checkpoint.save(ckpt, model, opt, {"step": steps}, state)
    return losses


def _checkpoint_blocks(chunks, flavour):
    """Every block of every stage recomputed in its backward (torch.utils.checkpoint)."""
    for c in chunks:
        for block in c.blocks.values():
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward,
                                              use_reentrant=flavour == "reentrant")


def _train_pipelined(tp, ep, schedule, v, steps, micro=MICRO, ckpt=None, resume=None, opt_name="sgd",
                     fsdp=False, recompute=None):
    state = moepar.init_parallel(tp, ep, pipeline_parallel_size=2, virtual_pipeline_size=v)
    num = pipeline.check_pipeline(schedule, 2, micro, CFG["layers"], v)
    ids = pipeline.stage_ids(state.pp_rank, 2, schedule, v)
    chunks = [GPT(GPTConfig(**CFG), state, stage=(i, num)) for i in ids]
    if recompute is not None:
        _checkpoint_blocks(chunks, recompute)
    if fsdp:   # each stage shards its own parameters over its stage's dp / edp groups
        chunks = [moepar.fully_shard(c, state) for c in chunks]
    model = chunks[0] if len(chunks) == 1 else pipeline.StageChunks(chunks)
    opt = _optimizer(model, opt_name)
    rows = local_rows(state.dp_rank, state.dp_size, micro)
    shapes = [c.stage_shapes(len(rows) // micro) for c in chunks]
    pipe = pipeline.Pipeline(chunks, schedule, micro, chunks[-1].loss, [s[0] for s in shapes],
                             [s[1] for s in shapes], state)
    start = 0
    if resume is not None:
        start = checkpoint.load(resume, model, opt, extra_keys=("step",), state=state)["step"]
    losses, events = [], []
    for step in range(start, steps):
        x, y = batch(step)
        with moepar.parallel.comm.track() as tracked:
            loss, aux = pipe.step(x[rows], y[rows])
        events += [(e.op, e.backward, e.nbytes, e.group_size) for e in tracked.events if e.op in ("send", "recv")]
        if not fsdp:
            moepar.allreduce_gradients(model, state)
        opt.step()
        opt.zero_grad()
        loss = loss.reshape(1)
        moepar.parallel.comm.all_reduce_(loss, state.dp_group)
        losses.append(float(loss) / state.dp_size)
    if ckpt is not None:
        checkpoint.save(ckpt, model, opt, {"step": steps}, state)
    coords = state.layout.coords(state.rank)
    sizes = {"ep": state.ep_size, "etp": state.etp_size, "tp": state.tp_size}
    whole = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p   # noqa: E731
    params = {n: (whole(p.detach()).clone(), {k: getattr(p, k) for k in ("moepar_expert", "moepar_expert_partition_dim",
                                                                 "tensor_model_parallel", "partition_dim")
                                       if hasattr(p, k)}) for n, p in model.named_parameters()}
    return losses, params, coords, sizes, events


def _check_exact(results, ref_losses, ref_params, tol=1e-5):
    seen = set()
    for rank, (losses, params, coords, sizes, _) in enumerate(results):
        assert len(losses) == len(ref_losses)
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= tol, (rank, losses, ref_losses)
        for name, (p, markers) in params.items():
            want = _stage_slice(ref_params[name], markers, coords, sizes)
            assert p.shape == want.shape, (rank, name)
            assert (p - want).abs().max().item() <= tol, (rank, name, (p - want).abs().max().item())
            seen.add(name)
    assert seen == set(ref_params)   # every parameter of the model lives on some stage


def _schedules(runs):
    return [_train_pipelined(1, 2, schedule, v, steps, micro, fsdp=fsdp == "fsdp",
                             recompute=fsdp if fsdp in ("reentrant", "non_reentrant") else None)
            for schedule, v, steps, micro, *fsdp in runs for fsdp in [fsdp[0] if fsdp else None]]


def test_pp2_ep2_trains_as_one_process():
    # 10 SGD steps of 1F1B and of interleaved 1F1B (v = 2: 4 stages of one block) at pp2 ep2
    # on 4 ranks: the losses and every parameter equal one process's within 1e-5.
    steps = 10
    ref_losses, ref_params = reference(steps)
    runs = [("1f1b", 1, steps, MICRO), ("interleaved", 2, steps, MICRO)]
    per_rank = run_ranks(_schedules, 4, runs)
    for i, (schedule, v, _, micro) in enumerate(runs):
        results = [r[i] for r in per_rank]
        _check_exact(results, ref_losses, ref_params)
        # Point-to-point rows: one activation and one gradient per micro-batch and boundary
        # side, [B/M/dp, S, D] fp32 each, over the pipeline group of 2.
        act = BATCH // micro // 2 * CFG["context"] * CFG["hidden"] * 4
        for rank, (*_, events) in enumerate(results):
            assert all(e[2] == act and e[3] == 2 for e in events), (schedule, rank, events[:2])
            assert len(events) == steps * micro * 2 * (2 * v - 1), (schedule, rank, len(events))
            assert {(e[0], e[1]) for e in events} == {("send", False), ("recv", False), ("send", True),
                                                      ("recv", True)} or v == 1


def test_pp2_tp2_ep2_on_eight_ranks_trains_as_one_process():
    ref_losses, ref_params = reference(10)
    _check_exact(run_ranks(_train_pipelined, 8, 2, 2, "1f1b", 1, 10), ref_losses, ref_params)


def test_every_schedule_gives_the_same_losses():
    # gpipe, the zero-bubble family and DualPipeV (4 micro-batches: it needs 2 pp), and 1F1B
    # with each stage under moepar.fully_shard, 2 steps.
    ref_losses, ref_params = reference(2, 4)
    runs = [("gpipe", 1, 2, 4), ("zb", 2, 2, 4), ("zbv", 2, 2, 4), ("dualpipev", 2, 2, 4), ("1f1b", 1, 2, 4, "fsdp")]
    per_rank = run_ranks(_schedules, 4, runs)
    for i, (schedule, *_) in enumerate(runs):
        _check_exact([r[i] for r in per_rank], ref_losses, ref_params)


def test_recomputed_stages_train_as_one_process():
    # Every block of every stage under activation recomputation, each flavour, micro-batches
    # in flight on each stage: 1F1B and interleaved (4 micro-batches), and the zero-bubble
    # split backward with the non-reentrant flavour (torch's reentrant flavour refuses the
    # input-only backward it runs). The losses, the aux loss and every parameter equal one
    # process's: each recompute replays its own micro-batch's routing, and the aux loss gets
    # its gradient also under the reentrant flavour (it got none before: the stage's hook
    # skipped the no_grad forward).
    ref_losses, ref_params = reference(2, 4)
    runs = [("1f1b", 1, 2, 4, "reentrant"), ("interleaved", 2, 2, 4, "reentrant"),
            ("1f1b", 1, 2, 4, "non_reentrant"), ("zb", 2, 2, 4, "non_reentrant")]
    per_rank = run_ranks(_schedules, 4, runs)
    for i, run in enumerate(runs):
        _check_exact([r[i] for r in per_rank], ref_losses, ref_params)


def test_checkpoint_from_pp2_to_pp1_and_back(tmp_path):
    # Saved after 3 AdamW steps at pp2 ep2 (the parameters and the optimizer's moments of
    # each stage's layers), loaded at pp1 ep2 (2 ranks) and pp1 ep1 (one process): the next
    # steps' losses are those of the run that never stopped. The pp1 ep2 run saves at step 5,
    # and pp2 tp2 ep2 (4 ranks) goes on from there to step 7, the same again.
    saved_at, back_at, steps = 3, 5, 7
    pp2, pp1 = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    full, _ = reference(steps, opt_name="adamw")
    run_ranks(_train_pipelined, 4, 1, 2, "1f1b", 1, saved_at, ckpt=pp2, opt_name="adamw")
    for losses in run_ranks(_train_flat, 2, 1, 2, back_at, pp2, ckpt=pp1):
        assert max(abs(a - b) for a, b in zip(losses, full[saved_at:back_at])) <= 1e-5, (losses, full)
    alone, _ = single_process(back_at, opt_name="adamw", resume=pp2)
    assert max(abs(a - b) for a, b in zip(alone, full[saved_at:back_at])) <= 1e-5, (alone, full)
    for losses, *_ in run_ranks(_train_pipelined, 4, 2, 2, "1f1b", 1, steps, resume=pp1, opt_name="adamw"):
        assert len(losses) == steps - back_at
        assert max(abs(a - b) for a, b in zip(losses, full[back_at:])) <= 1e-5, (losses, full)


def test_fully_sharded_stages_save_and_load_across_pipeline_layouts(tmp_path):
    # Each stage under moepar.fully_shard, 2 AdamW steps at pp2 ep2 with 1F1B; the checkpoint
    # continues in one process and at pp2 with the interleaved schedule (v = 2, sharded).
    ckpt = str(tmp_path / "fsdp")
    full, _ = reference(4, opt_name="adamw")
    run_ranks(_train_pipelined, 4, 1, 2, "1f1b", 1, 2, ckpt=ckpt, opt_name="adamw", fsdp=True)
    alone, _ = single_process(4, opt_name="adamw", resume=ckpt)
    assert max(abs(a - b) for a, b in zip(alone, full[2:])) <= 1e-5, (alone, full)
    for losses, *_ in run_ranks(_train_pipelined, 4, 1, 2, "interleaved", 2, 4, resume=ckpt, opt_name="adamw",
                                fsdp=True):
        assert max(abs(a - b) for a, b in zip(losses, full[2:])) <= 1e-5, (losses, full)


BAD = [
    (["--pp", "3"], "world_size=4 is not divisible by pipeline_parallel_size=3"),
    (["--pp", "2", "--layers", "3"], "layers=3 is not divisible by the 2 pipeline stages"),
    (["--pp", "2", "--microbatches", "1"], "microbatches=1 is fewer than schedule='1f1b' needs"),
    (["--pp", "2", "--schedule", "dualpipev", "--microbatches", "2"], "at least 4"),
    (["--pp", "2", "--schedule", "chimera"], "schedule='chimera' is not a pipeline schedule"),
]


def _example_errors(argvs):
    """Each argv's error from the example's checks (which run before init_parallel), and the
    whole example's exit code and stderr for the first; no group exists before either."""
    import contextlib
    import io

    from examples import train_gpt_moe
    messages = []
    for argv in argvs:
        try:
            train_gpt_moe.pipeline_options(train_gpt_moe.parse_args(argv))
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    assert moepar.parallel.groups._STATE is None   # no init_parallel ran
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = train_gpt_moe.main(argvs[0])
    return messages, rc, err.getvalue().strip()


def test_bad_pipelines_fail_on_every_rank_before_any_group():
    base = ["--layers", "2", "--hidden", "16", "--heads", "2", "--context", "8", "--experts", "4",
            "--steps", "1", "--batch-size", "8", "--quiet", "--out", "/tmp/never"]
    results = run_ranks(_example_errors, 4, [base + extra for extra, _ in BAD])
    assert all(r == results[0] for r in results), results      # the same errors on every rank
    messages, rc, stderr = results[0]
    for (extra, needle), message in zip(BAD, messages):
        assert message is not None and needle in message, (extra, message)
    assert rc == 2 and stderr == f"error: {messages[0]}"


def test_stage_placement_and_names():
    assert pipeline.stage_ids(0, 2, "1f1b") == [0] and pipeline.stage_ids(1, 2, "gpipe") == [1]
    assert pipeline.stage_ids(1, 2, "interleaved", 2) == [1, 3]         # torch's loop placement
    assert pipeline.stage_ids(0, 2, "dualpipev") == [0, 3]              # V: rank 0 first and last
    assert pipeline.stage_ids(1, 4, "zbv") == [1, 6]
    assert list(pipeline.layer_range(2, 4, 8)) == [4, 5]
    with pytest.raises(ValueError, match="valid names are .*'gpipe'.*'dualpipev'"):
        pipeline.schedule_kind("bfs")
    with pytest.raises(ValueError, match="microbatches=5 is not a multiple of the 2 rounds"):
        pipeline.check_pipeline("interleaved", 2, 5, virtual_pipeline_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 x 2 stage"):
        pipeline.check_pipeline("zbv", 2, 4, layers=6)
    # A plain list of blocks: stage 1 of 2 keeps blocks 2, 3 under their whole-model names.
    blocks = [torch.nn.Linear(3, 3) for _ in range(4)]
    stage = pipeline.cut_blocks(blocks, 1, 2, first=torch.nn.Identity(), last=torch.nn.Tanh())
    assert [n for n, _ in stage.named_parameters()] == ["blocks.2.weight", "blocks.2.bias",
                                                        "blocks.3.weight", "blocks.3.bias"]
    x = torch.randn(2, 3)
    assert torch.equal(stage(x), torch.tanh(blocks[3](blocks[2](x))))
    # The GPT's stages hold the whole model's parameters between them, under its names.
    whole = {n for n, _ in GPT(GPTConfig(**CFG)).named_parameters()}
    parts = [{n for n, _ in GPT(GPTConfig(**CFG), stage=(i, 4)).named_parameters()} for i in range(4)]
    assert set().union(*parts) == whole and sum(map(len, parts)) == len(whole)
    assert Layout(8, tp=2, ep=2, pp=2).pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


EXAMPLE = ["--layers", "4", "--hidden", "16", "--heads", "2", "--context", "8", "--experts", "4", "--topk", "2",
           "--expert-ffn", "16", "--dense-ffn", "16", "--batch-size", "8", "--microbatches", "4",
           "--steps", "2", "--eval-interval", "2", "--eval-batches", "1", "--sample-tokens", "0", "--quiet",
           "--hardware", "h100"]


def _example(argv):
    from examples import train_gpt_moe
    m = train_gpt_moe.train(train_gpt_moe.parse_args(argv))
    return m["losses"], m["val"]


def test_example_with_dualpipev_equals_its_one_process_run(tmp_path):
    # The training script end to end (a V-shaped schedule, validation, checkpoint, cost
    # report) at pp2 ep2, against the same script at pp 1 accumulating the same 4 micro-batches.
    one = _example(EXAMPLE + ["--out", str(tmp_path / "one")])
    argv = EXAMPLE + ["--pp", "2", "--ep", "2", "--schedule", "dualpipev", "--out", str(tmp_path / "pp")]
    for losses, val in run_ranks(_example, 4, argv):
        assert max(abs(a - b) for a, b in zip(losses, one[0])) <= 1e-5, (losses, one)
        assert val[0][0] == 2 and abs(val[0][1] - one[1][0][1]) <= 1e-5, (val, one)
