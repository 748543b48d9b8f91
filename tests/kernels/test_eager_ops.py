"""The kernels' eager path (an autograd Function, kernels/eager.py) and their registered
custom ops compute, save and differentiate alike: same outputs, same gradients, bitwise.
torch.compile takes the registered op (its opcheck tests live beside each kernel's)."""
import pytest
import torch

from moepar_kernels import permute as pk
from moepar_kernels import routing as rk


def _grads(fn, *leaves):
    outs = fn()
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view_as(o)).sum()
               for o in (outs if isinstance(outs, tuple) else (outs,)) if o.is_floating_point())
    loss.backward()
    return outs, [leaf.grad.clone() for leaf in leaves]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("drops", [False, True])
def test_permute_and_unpermute_eager_equal_the_custom_ops(impl, drops):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 8, generator=g)
    ids = torch.randint(0, 4, (9, 2), generator=g)
    dropped = torch.rand(9, 2, generator=g) < 0.3 if drops else None
    w = torch.rand(9, 2, generator=g)
    results = []
    for permute_fn, unpermute_fn in ((pk._permute_call, pk._unpermute_call), (pk._permute_op, pk._unpermute_op)):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()

        def run():
            x_ND, counts, row_map, route_N = permute_fn(xl, ids, dropped, 4, None, None, impl)
            y = unpermute_fn(x_ND * 2.0, row_map, wl, 9, impl, route_N)   # the permute's inverse kept
            y2 = unpermute_fn(x_ND * 3.0, row_map, wl, 9, impl)            # ... and rebuilt
            return y, y2, x_ND, counts, row_map, route_N
        results.append(_grads(run, xl, wl))
    (out_a, grads_a), (out_b, grads_b) = results
    for a, b in zip(out_a + tuple(grads_a), out_b + tuple(grads_b)):
        assert torch.equal(a, b)


def test_routing_eager_equals_the_custom_op():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(11, 6, generator=g)
    for aux_scale in (0.0, 0.3):   # without and with the load-balancing loss
        results = []
        for fn in (rk._routing_call, rk._routing_op):
            leaf = logits.clone().requires_grad_()
            results.append(_grads(lambda: fn(leaf, 2, "softmax", None, True, 1.0, aux_scale, 0, 0), leaf))
        (out_a, grads_a), (out_b, grads_b) = results
        for a, b in zip(out_a + tuple(grads_a), out_b + tuple(grads_b)):
            assert torch.equal(a, b)
