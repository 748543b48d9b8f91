"""Hardware descriptions: presets with cited public figures, and calibrated JSON profiles.

A ``Hardware`` prices a collective with its measured curve when it has one for that
(op, group size) on one node (a profile written by ``python -m moepar calibrate``), and
with the two-link alpha-beta model of ``collectives.py`` otherwise.

Preset figures (bandwidths are per GPU per direction: NVIDIA quotes NVLink and PCIe as
the bidirectional total, so 900 GB/s NVLink 4 is 450 GB/s each way):

- H100 SXM5 / H200 SXM: NVLink 4 through NVSwitch, 900 GB/s total; BF16 dense
  989.5 TFLOPS (the datasheets' 1,979 TFLOPS is with 2:4 sparsity); 80 GB / 141 GB.
  NVIDIA H100 and H200 Tensor Core GPU datasheets (nvidia.com/en-us/data-center/h100,
  /h200).
- A100 SXM4 80GB: NVLink 3, 600 GB/s total; BF16 dense 312 TFLOPS; 80 GB. NVIDIA A100
  datasheet (nvidia.com/en-us/data-center/a100).
- H100 PCIe: PCIe Gen5 x16, 128 GB/s total; BF16 dense 756.5 TFLOPS (1,513 with
  sparsity); 80 GB. NVIDIA H100 PCIe product brief PB-11133-001.
- Inter-node: one 400 Gb/s InfiniBand NDR port per GPU = 50 GB/s per direction (DGX H100:
  8 single-port ConnectX-7 at 400 Gb/s); DGX A100: 8 ConnectX-6 HDR at 200 Gb/s = 25 GB/s.
- Latencies are NCCL's own tuning model (src/graph/tuning.cc, Ring/Simple protocol):
  3.4 us per step on NVLink, 5.7 us on PCIe, 14 us on the network, 8.4 us base latency
  per collective. They are model constants, not measurements; ``calibrate`` replaces them.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Mapping

from .collectives import (DEFAULT_ALGO, Curve, Link, Placement, check_op, curves_from_dict,
                          curves_to_dict, link_time)

GB = 1e9
PROFILE_FORMAT = "moepar-profile/1"

NVLINK4 = Link("NVLink 4 (NVSwitch)", 450 * GB, 3.4e-6,
               "900 GB/s bidirectional per GPU, NVIDIA H100/H200 datasheets; latency: NCCL tuning.cc")
NVLINK3 = Link("NVLink 3 (NVSwitch)", 300 * GB, 3.4e-6,
               "600 GB/s bidirectional per GPU, NVIDIA A100 datasheet; latency: NCCL tuning.cc")
PCIE5 = Link("PCIe Gen5 x16", 64 * GB, 5.7e-6,
             "128 GB/s bidirectional, NVIDIA H100 PCIe product brief; latency: NCCL tuning.cc")
IB_NDR = Link("InfiniBand NDR 400 Gb/s per GPU", 50 * GB, 14e-6,
              "400 Gb/s ConnectX-7 per GPU (DGX H100); latency: NCCL tuning.cc")
IB_HDR = Link("InfiniBand HDR 200 Gb/s per GPU", 25 * GB, 14e-6,
              "200 Gb/s ConnectX-6 per GPU (DGX A100); latency: NCCL tuning.cc")
NCCL_BASE_LATENCY = 8.4e-6


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A machine type: links, GPUs per node, FLOP rate (FLOP/s per GPU), memory (bytes)."""

    name: str
    description: str
    intra: Link
    inter: Link
    gpus_per_node: int
    flops: float
    memory_bytes: float
    base_latency: float = 0.0
    sources: tuple[str, ...] = ()
    curves: Mapping[tuple[str, int], Curve] = dataclasses.field(default_factory=dict)
    meta: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: gpus_per_node={self.gpus_per_node} must be >= 1")
        if not self.flops > 0 or not self.memory_bytes > 0:
            raise ValueError(f"hardware {self.name!r}: flops={self.flops} and "
                             f"memory_bytes={self.memory_bytes} must be > 0")

    @property
    def calibrated(self) -> bool:
        return bool(self.curves)

    def curve_for(self, op: str, placement: Placement, algo: str | None = None) -> Curve | None:
        """The measured curve that prices this call, if any (one node, backend's algorithm)."""
        algo = check_op(op, algo)
        if placement.nodes != 1:
            return None
        if algo != DEFAULT_ALGO[op] and not (op == "all_to_all" and algo == "hierarchical"):
            return None  # a single-node hierarchical all-to-all is the flat one
        return self.curves.get((op, placement.size))

    def collective_time(self, op: str, placement: Placement, nbytes: float,
                        algo: str | None = None) -> float:
        """Predicted seconds for one collective of ``nbytes`` (nccl-tests size, per rank)."""
        if placement.size == 1:
            return 0.0
        curve = self.curve_for(op, placement, algo)
        if curve is not None:
            return curve.predict(nbytes)
        return link_time(op, placement, nbytes, self.intra, self.inter, algo, self.base_latency)

    def replace(self, **changes) -> "Hardware":
        return dataclasses.replace(self, **changes)


def _preset(name, description, intra, inter, flops_tf, memory_gb, sources) -> Hardware:
    return Hardware(name, description, intra, inter, 8, flops_tf * 1e12, memory_gb * GB,
                    NCCL_BASE_LATENCY, tuple(sources))


PRESETS: dict[str, Hardware] = {
    "h100": _preset("h100", "8x H100 SXM5 80GB per node, NVLink 4 + NVSwitch, 400G NDR per GPU",
                    NVLINK4, IB_NDR, 989.5, 80,
                    ["NVIDIA H100 datasheet: BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s, 80 GB",
                     "DGX H100: 8x ConnectX-7 400 Gb/s InfiniBand NDR (compute fabric)"]),
    "h200": _preset("h200", "8x H200 SXM 141GB per node, NVLink 4 + NVSwitch, 400G NDR per GPU",
                    NVLINK4, IB_NDR, 989.5, 141,
                    ["NVIDIA H200 datasheet: BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s, 141 GB",
                     "400 Gb/s InfiniBand NDR per GPU as in DGX H100/H200"]),
    "a100": _preset("a100", "8x A100 SXM4 80GB per node, NVLink 3 + NVSwitch, 200G HDR per GPU",
                    NVLINK3, IB_HDR, 312, 80,
                    ["NVIDIA A100 datasheet: BF16 312 TFLOPS dense, NVLink 600 GB/s, 80 GB",
                     "DGX A100: 8x ConnectX-6 200 Gb/s InfiniBand HDR (compute fabric)"]),
    "h100-pcie": _preset("h100-pcie", "8x H100 PCIe 80GB per node over PCIe Gen5, 400G NDR per GPU",
                         PCIE5, IB_NDR, 756.5, 80,
                         ["NVIDIA H100 PCIe product brief: BF16 1,513 TFLOPS with sparsity, "
                          "PCIe Gen5 128 GB/s, 80 GB", "400 Gb/s InfiniBand NDR per GPU"]),
}


def valid_hardware_names() -> str:
    return ", ".join(sorted(PRESETS)) + ", or the path of a JSON profile written by " \
        "`python -m moepar calibrate`"


def get_hardware(name: str | Hardware) -> Hardware:
    """A preset by name (case-insensitive) or a calibrated profile by path."""
    if isinstance(name, Hardware):
        return name
    key = str(name).strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if key.endswith(".json") or os.path.exists(name):
        return load_profile(name)
    raise ValueError(f"unknown hardware {name!r}; valid: {valid_hardware_names()}")


def _link_to_dict(link: Link) -> dict:
    return dataclasses.asdict(link)


def save_profile(hw: Hardware, path: str) -> None:
    """Write ``hw`` (typically a calibrated one) as JSON."""
    data = {
        "format": PROFILE_FORMAT, "name": hw.name, "description": hw.description,
        "gpus_per_node": hw.gpus_per_node, "flops": hw.flops, "memory_bytes": hw.memory_bytes,
        "base_latency": hw.base_latency, "sources": list(hw.sources),
        "intra": _link_to_dict(hw.intra), "inter": _link_to_dict(hw.inter),
        "meta": dict(hw.meta), "curves": curves_to_dict(hw.curves),
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def load_profile(path: str) -> Hardware:
    """Read a JSON profile; errors name the file and what is wrong with it."""
    if not os.path.exists(path):
        raise ValueError(f"hardware profile {path!r} does not exist; valid hardware: "
                         f"{valid_hardware_names()}")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile {path!r} is not valid JSON: {e}") from None
    if data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"hardware profile {path!r} has format {data.get('format')!r}, "
                         f"expected {PROFILE_FORMAT!r}")
    try:
        return Hardware(
            name=data["name"], description=data.get("description", ""),
            intra=Link(**data["intra"]), inter=Link(**data["inter"]),
            gpus_per_node=int(data["gpus_per_node"]), flops=float(data["flops"]),
            memory_bytes=float(data["memory_bytes"]), base_latency=float(data.get("base_latency", 0.0)),
            sources=tuple(data.get("sources", ())), curves=curves_from_dict(data.get("curves", [])),
            meta=data.get("meta", {}))
    except (KeyError, TypeError) as e:
        raise ValueError(f"hardware profile {path!r} is missing or has a bad field: {e}") from None


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine_description() -> str:
    """CPU model and core count (or GPU name): what the figures were measured on."""
    import platform

    import torch
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"
