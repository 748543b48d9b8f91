"""Hardware descriptions: presets with cited public figures, and calibrated JSON profiles.

A ``Hardware`` prices a collective with its measured curve when it has one for that
(op, group size) on one node (a profile written by ``python -m moepar calibrate``), and
with the two-link model of ``collectives.py`` otherwise: the intra-node link per GPU, and
``nics_per_node`` NICs shared by the node's GPUs. Each link carries its line rate and the
fraction of it NCCL achieves (``Link.efficiency``), from published nccl-tests bus
bandwidths. docs/cost.md lists every figure with its source; the short forms:

- line rates per GPU per direction (NVIDIA quotes NVLink as the bidirectional total):
  NVLink 4 450 GB/s (H100/H200 datasheets, 900 GB/s), H800 NVLink 200 GB/s (400 GB/s),
  NVLink 5 900 GB/s (B200/GB200, 1.8 TB/s), NVLink 3 300 GB/s (A100, 600 GB/s), PCIe Gen5
  x16 64 GB/s (128 GB/s); NICs 400 Gb/s NDR = 50 GB/s, 200 Gb/s HDR = 25 GB/s.
- efficiencies: NVLink 4 370/450 (NVIDIA, nccl-tests issue #212: "~20% protocol overhead,
  effective NVLink bandwidth of 370GB/s"); NDR 47/50 (NVIDIA, nccl-tests issue #290:
  "46-48GB/s per NIC"); HDR 24/25 (NVIDIA, nccl issue #812: 192 GB/s all-reduce busbw on
  DGX A100's 8 x 200 Gb/s); H800 NVLink 160/200 (DeepSeek-V3 report: "NVLink ... 160 GB/s").
- NVLS all-reduce on 8 H100/H200: busbw ~480 GB/s, algbw ~275 GB/s (nccl-tests #212).
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
                          curves_to_dict, link_time, pick_algo)

GB = 1e9
PROFILE_FORMAT = "moepar-profile/1"

NVLINK_EFF = 370 / 450     # nccl-tests #212: NCCL's effective NVLink 4 rate / line rate
NDR_EFF = 47 / 50          # nccl-tests #290: 46-48 GB/s per 400 Gb/s NIC
HDR_EFF = 24 / 25          # nccl #812: 192 GB/s busbw over 8 x 200 Gb/s (DGX A100)
NVLINK4 = Link("NVLink 4 (NVSwitch)", 450 * GB, 3.4e-6,
               "900 GB/s bidirectional per GPU, NVIDIA H100/H200 datasheets; 370 GB/s achieved, "
               "nccl-tests #212; latency: NCCL tuning.cc", NVLINK_EFF)
NVLINK4_H800 = Link("NVLink 4, H800 (NVSwitch)", 200 * GB, 3.4e-6,
                    "400 GB/s bidirectional per GPU, NVIDIA H800 datasheet; 160 GB/s achieved, "
                    "DeepSeek-V3 technical report sec. 3.2.2; latency: NCCL tuning.cc", 160 / 200)
NVLINK5 = Link("NVLink 5 (NVSwitch)", 900 * GB, 3.4e-6,
               "1.8 TB/s bidirectional per GPU, NVIDIA DGX B200 / GB200 NVL72; efficiency assumed "
               "as NVLink 4's (no published nccl-tests figure found); latency: NCCL tuning.cc", NVLINK_EFF)
NVLINK3 = Link("NVLink 3 (NVSwitch)", 300 * GB, 3.4e-6,
               "600 GB/s bidirectional per GPU, NVIDIA A100 datasheet; efficiency assumed as NVLink 4's; "
               "latency: NCCL tuning.cc", NVLINK_EFF)
PCIE5 = Link("PCIe Gen5 x16", 64 * GB, 5.7e-6,
             "128 GB/s bidirectional, NVIDIA H100 PCIe product brief; efficiency assumed as NVLink 4's; "
             "latency: NCCL tuning.cc", NVLINK_EFF)
IB_NDR = Link("InfiniBand NDR 400 Gb/s NIC", 50 * GB, 14e-6,
              "400 Gb/s ConnectX-7; 46-48 GB/s achieved, nccl-tests #290; latency: NCCL tuning.cc", NDR_EFF)
IB_HDR = Link("InfiniBand HDR 200 Gb/s NIC", 25 * GB, 14e-6,
              "200 Gb/s ConnectX-6 (DGX A100); 192 GB/s over 8, nccl #812; latency: NCCL tuning.cc", HDR_EFF)
NCCL_BASE_LATENCY = 8.4e-6
NVLS_H100_ALGBW = 275 * GB    # nccl-tests #212: NVLS all-reduce on 8 H100, algbw ~275 (busbw ~480) GB/s
MiB = 2 ** 20


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
    nics_per_node: int = 0            # NICs (``inter`` each) per node; 0: one per GPU
    nvls_algbw: float = 0.0           # NVLink SHARP all-reduce algbw inside a node; 0: none
    memory_bandwidth: float = 0.0     # HBM bytes/s per GPU (datasheet); 0: unknown

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: gpus_per_node={self.gpus_per_node!r} must be an "
                             f"integer >= 1")
        if not isinstance(self.nics_per_node, int) or self.nics_per_node < 0:
            raise ValueError(f"hardware {self.name!r}: nics_per_node={self.nics_per_node!r} must be an "
                             f"integer >= 1 (0: one per GPU)")
        for name in ("flops", "memory_bytes"):
            v = getattr(self, name)
            if not (v > 0 and v < float("inf")):
                raise ValueError(f"hardware {self.name!r}: {name}={v} must be a finite number > 0")
        for name in ("nvls_algbw", "memory_bandwidth", "base_latency"):
            v = getattr(self, name)
            if not (v >= 0 and v < float("inf")):
                raise ValueError(f"hardware {self.name!r}: {name}={v} must be a finite number >= 0")

    @property
    def nics(self) -> int:
        """NICs per node."""
        return self.nics_per_node or self.gpus_per_node

    @property
    def nic_share(self) -> float:
        """NICs per GPU: each GPU's share of its node's NICs."""
        return self.nics / self.gpus_per_node

    def with_gpus_per_node(self, gpus_per_node: int, nics_per_node: int | None = None) -> "Hardware":
        """The same machine with another node size; the NICs per GPU stay (rails: one NIC per
        GPU in DGX/HGX nodes) unless ``nics_per_node`` is given."""
        if nics_per_node is None:
            nics_per_node = max(1, round(self.nic_share * gpus_per_node))
        return self.replace(gpus_per_node=gpus_per_node, nics_per_node=nics_per_node)

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
        return link_time(op, placement, nbytes, self.intra, self.inter, algo, self.base_latency,
                         self.nic_share, self.nvls_algbw)

    def resolve_algo(self, op: str, placement: Placement, nbytes: float, algo: str | None = None) -> str:
        """The algorithm that prices this call: ``auto`` resolved to the fastest concrete one
        (kept as ``auto`` where a measured curve prices it: the backend chose)."""
        algo = check_op(op, algo)
        if placement.size == 1 or self.curve_for(op, placement, algo) is not None:
            return algo
        return pick_algo(op, placement, nbytes, self.intra, self.inter, algo, self.base_latency,
                         self.nic_share, self.nvls_algbw)

    def replace(self, **changes) -> "Hardware":
        return dataclasses.replace(self, **changes)


def _preset(name, description, intra, inter, flops_tf, memory_bytes, sources, nics=8, gpus=8,
            nvls=0.0, hbm_tbps=0.0) -> Hardware:
    return Hardware(name, description, intra, inter, gpus, flops_tf * 1e12, memory_bytes,
                    NCCL_BASE_LATENCY, tuple(sources), nics_per_node=nics, nvls_algbw=nvls,
                    memory_bandwidth=hbm_tbps * 1e12)


PRESETS: dict[str, Hardware] = {
    "h100": _preset("h100", "8x H100 SXM5 80GB per node, NVLink 4 + NVSwitch (NVLS), 8x 400G NDR",
                    NVLINK4, IB_NDR, 989.5, 81559 * MiB,
                    ["NVIDIA H100 datasheet: BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s, 3.35 TB/s HBM3",
                     "nvidia-smi memory.total of an H100 80GB HBM3: 81,559 MiB (79.6 GiB)",
                     "DGX H100: 8x ConnectX-7 400 Gb/s InfiniBand NDR (compute fabric)",
                     "nccl-tests #212, #290: NVLink 370 GB/s, NVLS all-reduce busbw ~480 GB/s, 46-48 GB/s per NIC"],
                    nvls=NVLS_H100_ALGBW, hbm_tbps=3.35),
    "h200": _preset("h200", "8x H200 SXM 141GB per node, NVLink 4 + NVSwitch (NVLS), 8x 400G NDR",
                    NVLINK4, IB_NDR, 989.5, 143771 * MiB,
                    ["NVIDIA H200 datasheet: BF16 1,979 TFLOPS with sparsity, NVLink 900 GB/s, 4.8 TB/s HBM3e",
                     "nvidia-smi memory.total of an H200: 143,771 MiB (140.4 GiB; 141 GB marketed)",
                     "8x 400 Gb/s InfiniBand NDR per node as DGX H100/H200",
                     "NVLink and NIC efficiencies as H100 (same NVLink 4 and ConnectX-7)"],
                    nvls=NVLS_H100_ALGBW, hbm_tbps=4.8),
    "h800": _preset("h800", "8x H800 SXM5 80GB per node, NVLink 400 GB/s + NVSwitch, 8x 400G NDR",
                    NVLINK4_H800, IB_NDR, 989.5, 81559 * MiB,
                    ["NVIDIA H800 datasheet: BF16 1,979 TFLOPS with sparsity, NVLink 400 GB/s, 80 GB",
                     "DeepSeek-V3 technical report (arXiv 2412.19437) sec. 3.2.2: NVLink 160 GB/s, IB 50 GB/s "
                     "per GPU (8 NICs per node)", "memory as H100 80GB (81,559 MiB)"], hbm_tbps=3.35),
    "a100": _preset("a100", "8x A100 SXM4 80GB per node, NVLink 3 + NVSwitch, 8x 200G HDR",
                    NVLINK3, IB_HDR, 312, 80 * GB,
                    ["NVIDIA A100 datasheet: BF16 312 TFLOPS dense, NVLink 600 GB/s, 80 GB, 2,039 GB/s HBM2e",
                     "DGX A100: 8x ConnectX-6 200 Gb/s InfiniBand HDR (compute fabric); nccl #812: 192 GB/s"],
                    hbm_tbps=2.039),
    "h100-pcie": _preset("h100-pcie", "8x H100 PCIe 80GB per node over PCIe Gen5, 8x 400G NDR",
                         PCIE5, IB_NDR, 756.5, 80 * GB,
                         ["NVIDIA H100 PCIe product brief: BF16 1,513 TFLOPS with sparsity, "
                          "PCIe Gen5 128 GB/s, 80 GB, 2.0 TB/s HBM2e", "400 Gb/s InfiniBand NDR per GPU (assumed)"],
                         hbm_tbps=2.0),
    "b200": _preset("b200", "8x B200 180GB per node (DGX B200), NVLink 5 + NVSwitch, 8x 400G NDR",
                    NVLINK5, IB_NDR, 2250, 180 * GB,
                    ["HGX B200 (1,000 W): BF16 2,250 TFLOPS dense, 4,500 with sparsity; 8 TB/s HBM3e",
                     "DGX B200 user guide: 8 B200 with 1,440 GB total, 8x ConnectX-7 400 Gb/s, NVLink 5 "
                     "1.8 TB/s per GPU"], hbm_tbps=8.0),
    "gb200-nvl72": _preset("gb200-nvl72", "GB200 NVL72: 72 B200 in one NVLink 5 domain, 400G NDR per GPU",
                           NVLINK5, IB_NDR, 2500, 186 * GB,
                           ["GB200 (1,200 W): BF16 2,500 TFLOPS dense; NVL72: 72 GPUs, 13.4 TB HBM3e "
                            "(186 GB each), 130 TB/s NVLink (1.8 TB/s per GPU), 8 TB/s HBM3e",
                            "one 400 Gb/s NIC per GPU assumed (as DGX B200; no source found here)"],
                           nics=72, gpus=72, hbm_tbps=8.0),
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
        "nics_per_node": hw.nics_per_node, "nvls_algbw": hw.nvls_algbw, "memory_bandwidth": hw.memory_bandwidth,
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
            meta=data.get("meta", {}), nics_per_node=int(data.get("nics_per_node", 0)),
            nvls_algbw=float(data.get("nvls_algbw", 0.0)), memory_bandwidth=float(data.get("memory_bandwidth", 0.0)))
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
