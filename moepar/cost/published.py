"""Published MoE pre-training runs: their layouts and throughput, as data, with the sources.

Each run is a plain dict: what the source publishes (system, GPUs, precision, global and
micro batch, sequence length, TP, PP, CP, VP, EP, gradient accumulation, tokens/s/GPU and
model TFLOP/s/GPU) and, under ``settings``, what the run did beyond its layout, each with the
source that says so. ``moepar.cost.published_check`` prices every run at its layout;
``python -m moepar validate --published`` prints the table docs/cost.md holds.

Sources (read on 2026-12-06):

- ``megatron-bridge-25.11``: NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md, section
  "25.11 NeMo Container", "Pre-Training Performance", at commit 5776a6d9 (2025-12-10, "25.11
  summary typo corrections"); every row of a MoE model (DeepSeek-V3, GPT-OSS 120B,
  Qwen3-30B-A3B, Qwen3-235B-A22B). The page's notes: MoE benchmarks force-balance the token
  distribution among experts and are token-dropless; "FP8-CS" is per-tensor current scaling,
  "FP8-MX" MXFP8 (32-element blocks). Its GA column disagrees with GBS / (MBS x DP) for two
  rows (GPT-OSS on H100, Qwen3-235B on GB300); the micro-batches priced are GBS / (MBS x DP).
- ``megatron-bridge-v0.2.0-configs``: the same repository's performance configs at tag v0.2.0
  (2025-11-26, the 25.11 release): scripts/performance/configs/*/workload_base_configs.py and
  *_llm_pretrain.py give each model's recomputation (``recompute_modules``, selective
  granularity for DeepSeek-V3) and the all-to-all overlap (``moe_a2a_overlap``) per system.
  Where a config's own layout differs from the table's (DeepSeek-V3 on GB300: PP4 EP64 in the
  config, PP2 EP32 in the table), its recomputation and overlap are still taken as the run's.
- ``megatron-bridge-26.08``: the same page at commit 4ab94dfa (2026-08-11, "update performance
  summary for 26.08"), the newest version read: its MXFP8 rows of the same four models on GB300
  and GB200 (the page no longer lists H100 or B200, BF16 or FP8-CS rows; DeepSeek-V4 Flash and
  the Nemotron hybrids are not models this cost model prices). Their settings: the recipes of
  that commit (src/megatron/bridge/perf_recipes/*/gb{200,300}/*.py and common.py): HybridEP with
  the all-to-all overlap (``overlap_moe_expert_parallel_comm``) for every one, recomputation of
  ``mla_up_proj`` for DeepSeek-V3 on GB200 and none on GB300; the GPT-OSS and Qwen3 recipes set
  none.
- ``deepseek-v3-report``: DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv 2412.19437 (v1
  2024-12-27): 2,048 H800 (sec. 3.1), 16-way pipeline (DualPipe) x 64-way expert parallelism
  over 8 nodes x ZeRO-1 data parallelism, no tensor parallelism (sec. 3.2), FP8 training
  with 1x128 activation and 128x128 weight blocks (sec. 3.3), recomputation of every RMSNorm
  and the MLA up-projections (sec. 3.2.3) and of the SwiGLU output from its FP8-cached input
  (sec. 3.3.3), node-limited routing to at most 4 nodes (sec. 2.1.2), the multi-token
  prediction module trained with the model (sec. 2.2), batch size 15,360 sequences of 4,096
  tokens after the ramp (sec. 4.2); throughput: 14.8T tokens pre-trained in 2.664M H800
  GPU-hours (sec. 1, table 1), i.e. 14.8e12 / (2.664e6 x 3600) = 1,543 tokens/s per GPU.
"""
from __future__ import annotations

SOURCES = {
    "megatron-bridge-25.11": (
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, '25.11 NeMo Container' pre-training tables",
        "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/5776a6d90b4dd8692902ab2eb581369484e19283/"
        "docs/performance-summary.md", "2025-12-10"),
    "megatron-bridge-v0.2.0-configs": (
        "NVIDIA-NeMo/Megatron-Bridge scripts/performance/configs at tag v0.2.0",
        "https://github.com/NVIDIA-NeMo/Megatron-Bridge/tree/v0.2.0/scripts/performance/configs", "2025-11-26"),
    "megatron-bridge-26.08": (
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, '26.08 NeMo Container' pre-training tables",
        "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/4ab94dfad36641cabdeb96452b21bf676aac4772/"
        "docs/performance-summary.md", "2026-08-11"),
    "megatron-bridge-26.08-recipes": (
        "NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/perf_recipes at the 26.08 summary's commit",
        "https://github.com/NVIDIA-NeMo/Megatron-Bridge/tree/4ab94dfad36641cabdeb96452b21bf676aac4772/"
        "src/megatron/bridge/perf_recipes", "2026-08-11"),
    "deepseek-v3-report": (
        "DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv 2412.19437", "https://arxiv.org/abs/2412.19437",
        "2024-12-27"),
}

_MB = "megatron-bridge-25.11"
_CFG = "megatron-bridge-v0.2.0-configs"
# Megatron-Bridge's NVL72 runs use 64 GPUs of each 72-GPU rack (256 GPUs = 4 racks of 64).
_NVL = 64


def _mb(system, model, gpus, precision, gbs, mbs, seq, tp, pp, cp, vp, ep, ga, tokens, tflops, source=_MB,
        settings_source=_CFG, **settings):
    hw = {"DGX-GB300": "gb300-nvl72", "DGX-GB200": "gb200-nvl72", "DGX-B200": "b200", "DGX-H100": "h100"}[system]
    return dict(source=source, system=system, model=model, hardware=hw, gpus=gpus,
                gpus_per_node=_NVL if hw.endswith("nvl72") else 8, precision=precision,
                dtype={"BF16": "bf16", "FP8-CS": "fp8", "FP8-MX": "mxfp8", "MXFP8": "mxfp8"}[precision], global_batch=gbs,
                micro_batch=mbs, seq_len=seq, tp=tp, pp=pp, cp=cp, vp=vp, ep=ep, published_ga=ga,
                tokens_per_s_per_gpu=tokens, model_tflops_per_gpu=tflops,
                settings={"source": settings_source, "recompute": "none", "recompute_modules": (), "a2a_overlap": False,
                          "mtp": False, **settings})


_DSV3_GB300 = dict(recompute="selective", recompute_modules=("moe_act",))
_DSV3_MLA = dict(recompute="selective", recompute_modules=("mla_up_proj",))
_OSS = dict(recompute="selective", recompute_modules=("layernorm", "moe_act"))
_A2A = dict(a2a_overlap=True)

RUNS = (
    # DGX-GB300
    _mb("DGX-GB300", "deepseek-v3", 256, "BF16", 4096, 1, 4096, 1, 2, 1, 4, 32, 32, 3848, 961, **_DSV3_GB300),
    _mb("DGX-GB300", "deepseek-v3", 256, "FP8-MX", 4096, 1, 4096, 1, 2, 1, 4, 32, 32, 4357, 1088, **_DSV3_GB300),
    _mb("DGX-GB300", "gpt-oss-120b", 64, "BF16", 1280, 2, 8192, 1, 1, 1, 1, 64, 10, 18347, 565),
    _mb("DGX-GB300", "qwen3-30b-a3b", 8, "FP8-MX", 512, 4, 4096, 1, 1, 1, 1, 8, 16, 28934, 666),
    _mb("DGX-GB300", "qwen3-235b-a22b", 256, "BF16", 8192, 2, 4096, 1, 4, 1, 12, 16, 32, 6131, 907),
    # DGX-GB200
    _mb("DGX-GB200", "deepseek-v3", 256, "BF16", 4096, 1, 4096, 1, 4, 1, 4, 64, 64, 3139, 782, **_DSV3_MLA),
    _mb("DGX-GB200", "deepseek-v3", 256, "FP8-MX", 4096, 1, 4096, 1, 8, 1, 4, 32, 128, 4018, 1003, **_DSV3_MLA),
    _mb("DGX-GB200", "gpt-oss-120b", 64, "BF16", 1280, 1, 8192, 1, 1, 1, 1, 64, 20, 15876, 488, **_OSS),
    _mb("DGX-GB200", "qwen3-30b-a3b", 8, "FP8-MX", 512, 4, 4096, 1, 1, 1, 1, 8, 16, 23766, 547),
    _mb("DGX-GB200", "qwen3-235b-a22b", 256, "BF16", 8192, 1, 4096, 1, 8, 1, 3, 32, 256, 4916, 728),
    # DGX-B200 (DeepSeek-V3 "w/ MTP": the MTP module trains too)
    _mb("DGX-B200", "deepseek-v3", 256, "FP8-MX", 2048, 1, 4096, 1, 16, 1, 1, 8, 128, 2139, 557, mtp=True,
        **_DSV3_MLA),
    _mb("DGX-B200", "gpt-oss-120b", 64, "BF16", 512, 4, 4096, 1, 1, 1, 1, 8, 2, 8213, 223, **_OSS),
    _mb("DGX-B200", "qwen3-30b-a3b", 8, "FP8-MX", 512, 1, 4096, 1, 1, 1, 1, 8, 64, 9299, 214),
    _mb("DGX-B200", "qwen3-235b-a22b", 64, "FP8-MX", 1024, 1, 4096, 1, 8, 1, 2, 8, 128, 3269, 484, **_A2A),
    # DGX-H100
    _mb("DGX-H100", "gpt-oss-120b", 64, "BF16", 512, 4, 4096, 1, 4, 1, 1, 8, 2, 5630, 153, **_OSS),
    _mb("DGX-H100", "qwen3-30b-a3b", 16, "FP8-CS", 512, 2, 4096, 1, 2, 1, 24, 8, 32, 5275, 121, **_A2A),
    _mb("DGX-H100", "qwen3-235b-a22b", 256, "FP8-CS", 2048, 1, 4096, 2, 8, 1, 4, 32, 128, 1575, 233, **_A2A),
    # DeepSeek-V3 technical report: 2,048 H800, PP16 (DualPipe) x EP64 x ZeRO-1 DP, FP8
    dict(source="deepseek-v3-report", system="H800 cluster", model="deepseek-v3", hardware="h800", gpus=2048,
         gpus_per_node=8, precision="FP8 (1x128 / 128x128 blocks)", dtype="fp8", global_batch=15360, micro_batch=1,
         seq_len=4096, tp=1, pp=16, cp=1, vp=2, ep=64, published_ga=None, tokens_per_s_per_gpu=1543,
         model_tflops_per_gpu=None,
         settings={"source": "deepseek-v3-report", "recompute": "selective",
                   "recompute_modules": ("layernorm", "mla_up_proj", "moe_act"), "a2a_overlap": True, "mtp": True,
                   "schedule": "dualpipev", "max_nodes_per_token": 4}),
)

# The same page's version of 2026-08-11 (26.08): MXFP8 on GB300 and GB200, every recipe with the
# all-to-all overlap (no GA column any more).
_NEW = dict(source="megatron-bridge-26.08", settings_source="megatron-bridge-26.08-recipes", a2a_overlap=True)
LATER_RUNS = (
    _mb("DGX-GB300", "deepseek-v3", 256, "MXFP8", 4096, 1, 4096, 1, 2, 1, 8, 32, None, 6288, 1635, **_NEW),
    _mb("DGX-GB200", "deepseek-v3", 256, "MXFP8", 4096, 1, 4096, 1, 4, 1, 4, 64, None, 4912, 1276, **_NEW,
        recompute="selective", recompute_modules=("mla_up_proj",)),
    _mb("DGX-GB300", "gpt-oss-120b", 64, "MXFP8", 1280, 4, 4096, 1, 1, 1, 1, 16, None, 33024, 1077, **_NEW),
    _mb("DGX-GB200", "gpt-oss-120b", 64, "MXFP8", 1280, 4, 4096, 1, 1, 1, 1, 64, None, 28672, 934, **_NEW),
    _mb("DGX-GB300", "qwen3-30b-a3b", 8, "MXFP8", 512, 8, 4096, 1, 1, 1, 1, 8, None, 44544, 1029, **_NEW),
    _mb("DGX-GB200", "qwen3-30b-a3b", 8, "MXFP8", 512, 4, 4096, 1, 1, 1, 1, 8, None, 39936, 923, **_NEW),
    _mb("DGX-GB300", "qwen3-235b-a22b", 256, "MXFP8", 8192, 2, 4096, 1, 4, 1, 12, 32, None, 8816, 1306, **_NEW),
    _mb("DGX-GB200", "qwen3-235b-a22b", 256, "MXFP8", 8192, 1, 4096, 1, 8, 1, 3, 32, None, 7280, 1077, **_NEW),
)

