"""The CPU buffer pool (moepar.moe.cpu): a buffer is handed out again only when
nothing else references its storage (tensors, views, tensors saved for backward), sizes
and eviction, and the MoE layer's results unchanged by reuse across steps."""
import pytest
import torch

from moepar.moe.layer import MoE
from moepar.moe import cpu
from moepar.moe.cpu import CpuBufferPool

MiB = 1 << 20


def ptr(t):
    return t.untyped_storage().data_ptr()


def test_buffer_is_reused_only_when_nothing_references_it():
    pool = CpuBufferPool()
    a = pool.empty((MiB // 4,), torch.float32)
    a_ptr = ptr(a)
    b = pool.empty((MiB // 4,), torch.float32)
    assert ptr(b) != a_ptr                      # a is alive
    v = a[10:20]
    del a
    c = pool.empty((MiB // 4,), torch.float32)
    assert ptr(c) not in (a_ptr, ptr(b))        # a's view is alive
    del v
    d = pool.empty((256, 1024), torch.float32)  # same bytes, another shape
    assert ptr(d) == a_ptr and d.shape == (256, 1024)
    assert pool.stats()["buffers"] == 3 and pool.stats()["hits"] == 1


def test_tensor_saved_for_backward_keeps_its_buffer():
    pool = CpuBufferPool()
    a = pool.empty((1024, 256), torch.float32).copy_(torch.randn(1024, 256))
    expected = a.clone()
    w = torch.randn(256, requires_grad=True)
    loss = (a * w).sum()                        # autograd saves a for w's gradient
    a_ptr = ptr(a)
    del a
    other = pool.empty((1024, 256), torch.float32)
    assert ptr(other) != a_ptr
    other.fill_(123.0)
    (gw,) = torch.autograd.grad(loss, w)
    torch.testing.assert_close(gw, expected.sum(0))
    del loss, gw
    assert ptr(pool.empty((1024, 256), torch.float32)) == a_ptr   # graph freed: reusable


def test_sizes_round_up_and_free_buffers_up_to_twice_the_request_are_taken():
    pool = CpuBufferPool()
    x = pool.empty((3 * MiB // 2,), torch.uint8)                  # 1.5 MiB: its own size class
    assert pool.stats()["held_bytes"] == 3 * MiB // 2
    y = pool.empty((3 * MiB // 2 + 1,), torch.uint8)              # rounded up to 1.75 MiB
    assert pool.stats()["held_bytes"] == 3 * MiB // 2 + 7 * MiB // 4
    x_ptr = ptr(x)
    del x, y
    z = pool.empty((MiB,), torch.uint8)                           # the smallest free buffer >= 1 MiB
    assert ptr(z) == x_ptr
    del z
    pool.empty((MiB // 2,), torch.uint8)                          # 1.5 MiB > 2 x 0.5 MiB: a new one
    assert pool.stats()["buffers"] == 3


def test_free_bytes_are_capped_and_release_forgets_everything():
    pool = CpuBufferPool(max_free_bytes=2 * MiB)
    held = [pool.empty((MiB,), torch.uint8) for _ in range(4)]
    del held
    assert pool.stats()["free_bytes"] == 4 * MiB
    keep = pool.empty((8 * MiB,), torch.uint8)                     # a miss: evicts down to the cap
    assert pool.stats()["free_bytes"] == 2 * MiB
    pool.release()
    assert pool.stats()["buffers"] == 0
    assert keep.numel() == 8 * MiB


def test_public_names_release_the_pool():
    import moepar
    keep = cpu.empty((MiB,), torch.float32)
    assert moepar.cpu_buffer_stats()["held_bytes"] >= 4 * MiB
    moepar.release_cpu_buffers()
    assert moepar.cpu_buffer_stats()["held_bytes"] == 0 and keep.numel() == MiB


def test_module_level_empty_small_and_disabled(monkeypatch):
    monkeypatch.setattr(cpu.POOL, "min_bytes", MiB)
    before = cpu.stats()["misses"] + cpu.stats()["hits"]
    small = cpu.empty((10, 10), torch.float32)
    assert small.shape == (10, 10)
    assert cpu.stats()["misses"] + cpu.stats()["hits"] == before
    with cpu.pool_disabled():
        cpu.empty((MiB,), torch.float32)
    assert cpu.stats()["misses"] + cpu.stats()["hits"] == before
    cpu.empty((MiB,), torch.float32)
    assert cpu.stats()["misses"] + cpu.stats()["hits"] == before + 1


def test_permute_kernels_take_their_cpu_outputs_from_the_pool(monkeypatch):
    """The dense permute gather and the unpermute backward's grad_y are pooled buffers on
    the CPU (kernels cannot import moepar: moepar.moe.cpu installs the pool there), and a
    second step reuses the first one's once it is released."""
    from moepar_kernels import permute as kp
    monkeypatch.setattr(cpu.POOL, "min_bytes", 0)
    x = torch.randn(64, 32, requires_grad=True)
    ids = torch.randint(0, 4, (64, 2), generator=torch.Generator().manual_seed(0))
    ptrs = []
    for _ in range(2):
        before = cpu.stats()
        y, _, row_map = kp.permute(x, ids, None, 4, impl="reference")
        out = kp.unpermute(y, row_map, None, 64, impl="reference")
        (g,) = torch.autograd.grad(out.sum(), [y])
        after = cpu.stats()
        assert after["hits"] + after["misses"] >= before["hits"] + before["misses"] + 2
        ptrs.append((ptr(y), ptr(g)))
        del y, out, g, row_map
    assert ptrs[1] == ptrs[0]


@pytest.mark.parametrize("pool", [True, False])
def test_layer_outputs_and_grads_survive_later_steps(monkeypatch, pool):
    """Step 1's output and gradients, still held, are unchanged by steps 2 and 3 (which
    would reuse their buffers if the pool ignored live references), and every step
    equals the same step with the pool off."""
    monkeypatch.setattr(cpu.POOL, "enabled", pool)
    monkeypatch.setattr(cpu.POOL, "min_bytes", 0)
    torch.manual_seed(0)
    moe = MoE(32, 4, 1, k=2, ffn_hidden=48, init_seed=3)
    xs = [torch.randn(64, 32, requires_grad=True) for _ in range(3)]
    outs = []
    for x in xs:
        y = moe(x)
        gx, gw1 = torch.autograd.grad(y.square().sum(), [x, moe.experts.w1])
        outs.append((y, gx, gw1, y.detach().clone(), gx.clone(), gw1.clone()))
    for y, gx, gw1, y0, gx0, gw10 in outs:
        assert torch.equal(y.detach(), y0) and torch.equal(gx, gx0) and torch.equal(gw1, gw10)
    with cpu.pool_disabled():
        y = moe(xs[1])
    torch.testing.assert_close(y, outs[1][0], rtol=0, atol=0)


_EXCHANGE = {"source-major": True, "regroup": False}


def _ep_steps_hold_outputs(mode: str):
    """ep=2 layer, three steps whose outputs and input gradients are all kept: with the
    pool (every buffer pooled) each equals the same step with the pool off."""
    from moepar.parallel import init_parallel
    state = init_parallel(1, 2, verbose=False)
    moe = MoE(16, 8, 2, k=2, ffn_hidden=24, init_seed=5, state=state, dedup="off",
              cpu_source_major=_EXCHANGE[mode])
    gen = torch.Generator().manual_seed(state.ep_rank)
    xs = [torch.randn(20 + 7 * i, 16, generator=gen).requires_grad_(True) for i in range(3)]
    held = []
    for x in xs:
        y = moe(x)
        (gx,) = torch.autograd.grad(y.square().sum(), [x])
        held.append((y, gx, y.detach().clone(), gx.clone()))
    same = all(torch.equal(y.detach(), y0) and torch.equal(gx, gx0) for y, gx, y0, gx0 in held)
    diffs = []
    with cpu.pool_disabled():
        for x, (y, gx, _, _) in zip(xs, held):
            y2 = moe(x)
            (gx2,) = torch.autograd.grad(y2.square().sum(), [x])
            diffs.append(max(float((y2 - y).abs().max()), float((gx2 - gx).abs().max())))
    return same, max(diffs), cpu.stats()["hits"] > 0


@pytest.mark.parametrize("mode", list(_EXCHANGE))
def test_expert_parallel_steps_with_pooled_all_to_all_buffers(mode):
    from ..helpers.multiproc import run_ranks
    for same, diff, reused in run_ranks(_ep_steps_hold_outputs, 2, mode):
        assert same and reused
        assert diff == 0.0
