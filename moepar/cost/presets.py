"""The hardware presets: links, FLOP rates, memory, each figure with its public source.

Line rates per GPU per direction (NVIDIA quotes NVLink as the bidirectional total): NVLink 4
450 GB/s (H100/H200 datasheets, 900 GB/s), H800 NVLink 200 GB/s (400 GB/s), NVLink 5 900 GB/s
(B200/GB200/GB300, 1.8 TB/s), NVLink 3 300 GB/s (A100, 600 GB/s), PCIe Gen5 x16 64 GB/s (128
GB/s); NICs 800 Gb/s XDR = 100 GB/s, 400 Gb/s NDR = 50 GB/s, 200 Gb/s HDR = 25 GB/s.
Efficiencies (what NCCL achieves of the line rate): NVLink 4 370/450 (NVIDIA, nccl-tests issue
#212: "~20% protocol overhead, effective NVLink bandwidth of 370GB/s"); NDR 47/50 (NVIDIA,
nccl-tests issue #290: "46-48GB/s per NIC"); HDR 24/25 (NVIDIA, nccl issue #812: 192 GB/s
all-reduce busbw on DGX A100's 8 x 200 Gb/s); H800 NVLink 160/200 (DeepSeek-V3 report:
"NVLink ... 160 GB/s"). NVLS all-reduce on 8 H100/H200: busbw ~480 GB/s, algbw ~275 GB/s
(nccl-tests #212). Latencies: NCCL's tuning model (src/graph/tuning.cc, Ring/Simple): 3.4 us
per step on NVLink, 5.7 us on PCIe, 14 us on the network, 8.4 us base latency per collective.

FLOP rates are dense (no 2:4 sparsity): ``flops`` the BF16 rate, ``fp8_flops`` the FP8 rate
(MXFP8 on Blackwell runs at it), each the datasheet's "with sparsity" figure halved where
NVIDIA quotes that one. ``generation`` keys the compute efficiencies of
``moepar.cost.compute``; ``nvlink_domain`` is the GPUs one NVLink domain holds (an NVL72
rack's 72), of which a run may use fewer (``--gpus-per-node 64``). docs/cost.md lists every
figure with its source.
"""
from __future__ import annotations

from .collectives import Hardware, Link

GB = 1e9
MiB = 2 ** 20

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
IB_XDR = Link("ConnectX-8 800 Gb/s NIC", 100 * GB, 14e-6,
              "800 Gb/s ConnectX-8 SuperNIC per GPU (GB300 NVL72); efficiency assumed as NDR's 47/50; "
              "latency: NCCL tuning.cc", NDR_EFF)
IB_NDR = Link("InfiniBand NDR 400 Gb/s NIC", 50 * GB, 14e-6,
              "400 Gb/s ConnectX-7; 46-48 GB/s achieved, nccl-tests #290; latency: NCCL tuning.cc", NDR_EFF)
IB_HDR = Link("InfiniBand HDR 200 Gb/s NIC", 25 * GB, 14e-6,
              "200 Gb/s ConnectX-6 (DGX A100); 192 GB/s over 8, nccl #812; latency: NCCL tuning.cc", HDR_EFF)
NCCL_BASE_LATENCY = 8.4e-6
NVLS_H100_ALGBW = 275 * GB    # nccl-tests #212: NVLS all-reduce on 8 H100, algbw ~275 (busbw ~480) GB/s


def _preset(name, description, intra, inter, flops_tf, memory_bytes, sources, nics=8, gpus=8,
            nvls=0.0, hbm_tbps=0.0, fp8_tf=0.0, generation="", domain=0) -> Hardware:
    return Hardware(name, description, intra, inter, gpus, flops_tf * 1e12, memory_bytes,
                    NCCL_BASE_LATENCY, tuple(sources), nics_per_node=nics, nvls_algbw=nvls,
                    memory_bandwidth=hbm_tbps * 1e12, fp8_flops=fp8_tf * 1e12, generation=generation,
                    nvlink_domain=domain or gpus)


PRESETS: dict[str, Hardware] = {
    "h100": _preset("h100", "8x H100 SXM5 80GB per node, NVLink 4 + NVSwitch (NVLS), 8x 400G NDR",
                    NVLINK4, IB_NDR, 989.5, 81559 * MiB,
                    ["NVIDIA H100 datasheet: BF16 1,979 and FP8 3,958 TFLOPS with sparsity, NVLink 900 GB/s, "
                     "3.35 TB/s HBM3",
                     "nvidia-smi memory.total of an H100 80GB HBM3: 81,559 MiB (79.6 GiB)",
                     "DGX H100: 8x ConnectX-7 400 Gb/s InfiniBand NDR (compute fabric)",
                     "nccl-tests #212, #290: NVLink 370 GB/s, NVLS all-reduce busbw ~480 GB/s, 46-48 GB/s per NIC"],
                    nvls=NVLS_H100_ALGBW, hbm_tbps=3.35, fp8_tf=1979, generation="hopper"),
    "h200": _preset("h200", "8x H200 SXM 141GB per node, NVLink 4 + NVSwitch (NVLS), 8x 400G NDR",
                    NVLINK4, IB_NDR, 989.5, 143771 * MiB,
                    ["NVIDIA H200 datasheet: BF16 1,979 and FP8 3,958 TFLOPS with sparsity, NVLink 900 GB/s, "
                     "4.8 TB/s HBM3e",
                     "nvidia-smi memory.total of an H200: 143,771 MiB (140.4 GiB; 141 GB marketed)",
                     "8x 400 Gb/s InfiniBand NDR per node as DGX H100/H200",
                     "NVLink and NIC efficiencies as H100 (same NVLink 4 and ConnectX-7)"],
                    nvls=NVLS_H100_ALGBW, hbm_tbps=4.8, fp8_tf=1979, generation="hopper"),
    "h800": _preset("h800", "8x H800 SXM5 80GB per node, NVLink 400 GB/s + NVSwitch, 8x 400G NDR",
                    NVLINK4_H800, IB_NDR, 989.5, 81559 * MiB,
                    ["NVIDIA H800 datasheet: BF16 1,979 and FP8 3,958 TFLOPS with sparsity, NVLink 400 GB/s, 80 GB",
                     "DeepSeek-V3 technical report (arXiv 2412.19437) sec. 3.2.2: NVLink 160 GB/s, IB 50 GB/s "
                     "per GPU (8 NICs per node)", "memory as H100 80GB (81,559 MiB)"],
                    hbm_tbps=3.35, fp8_tf=1979, generation="hopper"),
    "a100": _preset("a100", "8x A100 SXM4 80GB per node, NVLink 3 + NVSwitch, 8x 200G HDR",
                    NVLINK3, IB_HDR, 312, 80 * GB,
                    ["NVIDIA A100 datasheet: BF16 312 TFLOPS dense (no FP8), NVLink 600 GB/s, 80 GB, "
                     "2,039 GB/s HBM2e",
                     "DGX A100: 8x ConnectX-6 200 Gb/s InfiniBand HDR (compute fabric); nccl #812: 192 GB/s"],
                    hbm_tbps=2.039, generation="ampere"),
    "h100-pcie": _preset("h100-pcie", "8x H100 PCIe 80GB per node over PCIe Gen5, 8x 400G NDR",
                         PCIE5, IB_NDR, 756.5, 80 * GB,
                         ["NVIDIA H100 PCIe product brief: BF16 1,513 and FP8 3,026 TFLOPS with sparsity, "
                          "PCIe Gen5 128 GB/s, 80 GB, 2.0 TB/s HBM2e", "400 Gb/s InfiniBand NDR per GPU (assumed)"],
                         hbm_tbps=2.0, fp8_tf=1513, generation="hopper"),
    "b200": _preset("b200", "8x B200 180GB per node (DGX B200), NVLink 5 + NVSwitch, 8x 400G NDR",
                    NVLINK5, IB_NDR, 2250, 180 * GB,
                    ["HGX B200 (1,000 W): BF16 2,250 and FP8 4,500 TFLOPS dense; 8 TB/s HBM3e",
                     "DGX B200 user guide: 8 B200 with 1,440 GB total, 8x ConnectX-7 400 Gb/s, NVLink 5 "
                     "1.8 TB/s per GPU"], hbm_tbps=8.0, fp8_tf=4500, generation="blackwell"),
    "gb200-nvl72": _preset("gb200-nvl72", "GB200 NVL72: 72 B200 in one NVLink 5 domain, 400G NDR per GPU",
                           NVLINK5, IB_NDR, 2500, 186 * GB,
                           ["GB200 (1,200 W): BF16 2,500 and FP8 5,000 TFLOPS dense (NVL72: 360 and 720 PFLOPS "
                            "with sparsity over 72 GPUs); 13.4 TB HBM3e (186 GB each), 130 TB/s NVLink "
                            "(1.8 TB/s per GPU), 8 TB/s HBM3e",
                            "one 400 Gb/s NIC per GPU assumed (as DGX B200; no source found here)"],
                           nics=72, gpus=72, hbm_tbps=8.0, fp8_tf=5000, generation="blackwell"),
    "gb300-nvl72": _preset("gb300-nvl72", "GB300 NVL72: 72 B300 in one NVLink 5 domain, 800G ConnectX-8 per GPU",
                           NVLINK5, IB_XDR, 2500, 288 * GB,
                           ["GB300 (Blackwell Ultra, 1,400 W): BF16 2,500 and FP8 5,000 TFLOPS dense, 288 GB "
                            "HBM3e at 8 TB/s (per-GPU table of GB300 / GB200 / B300 / B200, verda.com's GB300 "
                            "NVL72 article; NVIDIA: 20 TB HBM3e over 72 GPUs, 576 TB/s)",
                            "NVL72: 72 GPUs in one NVLink 5 domain, 130 TB/s (1.8 TB/s per GPU); 72 ConnectX-8 "
                            "800 Gb/s NICs (glennklockwood.com/garden/processors/B300, NVIDIA's GB300 NVL72 "
                            "figures)"],
                           nics=72, gpus=72, hbm_tbps=8.0, fp8_tf=5000, generation="blackwell-ultra"),
}
