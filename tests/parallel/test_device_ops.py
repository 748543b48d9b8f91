"""How many device ops, Triton launches and Python calls one MoE forward and backward issue,
counted on fake CUDA (tests/helpers/fake_cuda) by ``moepar.bench.ops`` (``python -m moepar
bench ops`` prints the same counts as a table; its docstring says what is counted).

On a GPU at the benchmark sizes the layer is host-bound (the issue cost of an op and of a
Triton launch against the device's busy time were measured on an H200: docs/benchmarks.md,
"First GPU run"). So the number of ops and the Python run per step are the host's cost, and
they are held to a budget here (world of one, bf16, T 64, D 32, F 64, E 8, K 2, dropless,
aux loss on): a change that adds ops to the default path fails and must raise the budget on
purpose. The budget is relative to torchtitan's MoE at the same shapes and function (SwiGLU
experts): against the peer counted in the same run where torchtitan is installed (the suite's
setup installs it), against its count recorded below where it is not."""
import torch

from moepar.bench import ops
from moepar.bench.peers import torchtitan_status

from ..helpers.multiproc import run_ranks

SHAPE = ops.CONFIGS["small"]
BUDGET = {"forward": (17, 3), "backward": (18, 3)}   # the default layer (GELU): (aten device ops, Triton launches)

# Recorded on 2026-12-06 with torch 2.13.0 and torchtitan 0.3.0 (python -m moepar bench ops
# --configs small): device ops + Triton launches and Python calls per forward + backward.
RECORDED = {"moepar": {"ops": 50, "python": 309}, "torchtitan": {"ops": 68, "python": 112}}
# Python calls are mostly torch's own frames, which differ from one torch release to the
# next: the recorded Python counts hold on the torch they were recorded with.
RECORDED_TORCH = "2.13."
# The targets: moepar's device ops + launches at most 0.75x torchtitan's, its Python
# calls at most torchtitan's. The ops target is held; the Python one is not met yet
# (docs/benchmarks.md has both figures), so it is reported, and held once it is.
PEER_RATIO_TARGET = 0.75
PEER_PYTHON_TARGET = 1.0
HOLD_PEER_TARGETS = True
HOLD_PEER_PYTHON_TARGET = False

MOEPAR_ROW = ("moepar", {"activation": "swiglu"})    # aux loss on (the default)
DEFAULT_ROW = ("moepar", {})


def _count(rows):
    return [ops.count_layer(impl, SHAPE, options) for impl, options in rows]


def _totals(c):
    return {"ops": sum(len(v) for v in c["ops"].values()) + sum(len(v) for v in c["launches"].values()),
            "python": sum(c["python_calls"].values())}


def test_one_forward_and_backward_stay_within_their_device_op_budget():
    (c,) = run_ranks(_count, 1, [DEFAULT_ROW], fake_cuda=True)[0]
    for phase, (ops_budget, launch_budget) in BUDGET.items():
        n_ops, launches = c["ops"][phase], c["launches"][phase]
        assert len(n_ops) >= 10 and launches, f"{phase}: the instrument counted almost nothing: {n_ops} {launches}"
        assert len(n_ops) <= ops_budget and len(launches) <= launch_budget, (
            f"{phase}: {len(n_ops)} device ops and {len(launches)} Triton launches, budget {ops_budget} + "
            f"{launch_budget} (each op is host time on a GPU; docs/benchmarks.md): ops {sorted(n_ops)}, "
            f"launches {launches}")


def test_host_work_per_step_against_torchtitan():
    have_peer, why = torchtitan_status()
    rows = [MOEPAR_ROW] + ([("torchtitan", {"activation": "swiglu"})] if have_peer else [])
    counts = run_ranks(_count, 1, rows, fake_cuda=True)[0]
    mine = _totals(counts[0])
    assert mine["python"] >= 100 and counts[0]["launches"]["forward"], f"the counters saw almost nothing: {mine}"
    if have_peer:
        peer = _totals(counts[1])
        assert not any(counts[1]["launches"].values()) and peer["ops"] >= 20 and peer["python"] >= 100, peer
        source = "counted in this run"
    else:
        peer, source = RECORDED["torchtitan"], f"recorded ({why})"
    ratio_ops, ratio_py = mine["ops"] / peer["ops"], mine["python"] / peer["python"]
    report = (f"moepar / torchtitan ({source}): device ops + launches {mine['ops']} / {peer['ops']} = "
              f"{ratio_ops:.2f}x (target {PEER_RATIO_TARGET}x), Python calls {mine['python']} / {peer['python']} "
              f"= {ratio_py:.2f}x (target {PEER_PYTHON_TARGET}x)")
    print(ops.table({"small": dict(zip(["moepar swiglu aux on", "torchtitan"], counts))}))
    print(report)
    assert mine["ops"] <= RECORDED["moepar"]["ops"], f"more device ops + launches than recorded: {report}"
    if torch.__version__.startswith(RECORDED_TORCH):
        assert mine["python"] <= RECORDED["moepar"]["python"], f"more Python calls than recorded: {report}"
    if HOLD_PEER_TARGETS:
        assert ratio_ops <= PEER_RATIO_TARGET, report
    if HOLD_PEER_PYTHON_TARGET:
        assert ratio_py <= PEER_PYTHON_TARGET, report
