"""Moving small values between the host and the device without draining the GPU.

On CUDA every host read of a device value (``.item()``, ``.tolist()``, ``.cpu()``, ``int(t)``)
waits until the stream has run everything queued before it, and a copy of host data to the
device from pageable memory (``torch.tensor(values, device="cuda")``) waits too. The MoE
forward needs exactly one host read: the counts exchange's result, which sizes the token
all-to-all (Megatron-Core's ``_maybe_dtoh_and_synchronize`` and torchtitan's dispatcher read
the same counts once). These two helpers are the only places moepar's hot path crosses:

* ``read_to_host``: a non-blocking copy into pinned memory and a wait on its event. The
  copy is queued on the current stream: nothing is queued between the exchange and this
  read that the host could let run ahead (Megatron-Core uses a side stream because it
  queues its permutation in between), so an event on the current stream waits for exactly
  what the read needs.
* ``to_device``: pinned staging and a non-blocking copy, for the rare host-computed
  tensors the device needs (the receive guard's quotas).

On the CPU both return their argument: there the "device" is the host.
"""
from __future__ import annotations

import torch


def read_to_host(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values on the host (``t`` itself on the CPU)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    event = torch.Event(t.device)
    event.record(torch.accelerator.current_stream(t.device))
    event.synchronize()
    return out


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device``, queued without blocking the host."""
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
