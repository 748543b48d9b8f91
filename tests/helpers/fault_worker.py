"""The example GPT-MoE with one fault injected: a worker script for tests/parallel/test_faults.py.

    python tests/helpers/fault_worker.py --fault KIND:RANK:WHEN:STEP -- <train_gpt_moe.py arguments>

runs ``examples/train_gpt_moe.main`` on every rank; rank RANK, in the first attempt only
(torchrun's TORCHELASTIC_RESTART_COUNT 0), does KIND when WHEN comes for train step STEP:

* KIND ``kill``: SIGKILL itself (a process the OOM killer or a dead node takes away);
  ``sleep``: sleep for an hour (a stalled peer: a hung NIC, a stuck kernel).
* WHEN ``forward``: inside the last MoE layer's forward of step STEP (1-based), before the
  layer's first collective, so its peers are inside the layer waiting on it;
  ``after-checkpoint``: right after the checkpoint of step STEP is committed.

Before the fault it writes ``<out>/fault.json`` (rank, time), so the test can measure how
long the other ranks took to give up.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from examples import train_gpt_moe  # noqa: E402


def _fault(kind: str, out: str, rank: int) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fault.json"), "w") as f:
        json.dump({"rank": rank, "kind": kind, "time": time.time()}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)


def install(spec: str, out: str) -> None:
    kind, rank, when, step = spec.split(":")
    rank, step = int(rank), int(step)
    if int(os.environ.get("RANK", "0")) != rank or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != 0:
        return
    if when == "forward":
        build = train_gpt_moe.build

        def build_with_fault(args, device):
            state, cfg, model, opt = build(args, device)
            last_moe = [m for m in model.modules() if isinstance(m, train_gpt_moe.moepar.MoE)][-1]
            calls = [0]

            def pre_hook(module, inputs):
                calls[0] += 1
                if calls[0] == step:
                    _fault(kind, out, rank)
            last_moe.register_forward_pre_hook(pre_hook)
            return state, cfg, model, opt
        train_gpt_moe.build = build_with_fault
    elif when == "after-checkpoint":
        save = train_gpt_moe.checkpoint.save_checkpoint

        def save_then_fault(root, at_step, *args, **kwargs):
            path = save(root, at_step, *args, **kwargs)
            if at_step == step:
                _fault(kind, out, rank)
            return path
        train_gpt_moe.checkpoint.save_checkpoint = save_then_fault
    else:
        raise ValueError(f"unknown WHEN {when!r} in --fault {spec!r}")


def main() -> int:
    argv = sys.argv[1:]
    if len(argv) < 3 or argv[0] != "--fault" or argv[2] != "--":
        raise SystemExit(__doc__)
    spec, rest = argv[1], argv[3:]
    install(spec, train_gpt_moe.parse_args(rest).out)
    return train_gpt_moe.main(rest)


if __name__ == "__main__":
    sys.exit(main())
