"""FLOPs of the T5 family, the one formula: read by the training metrics (MFU), the benchmarks and the
pipeline balance; and what GPUs can do (peaks, memory, links), for MFU and the layout planner."""

from __future__ import annotations

from dataclasses import dataclass

from t5forge.models.t5 import T5Config


def block_forward_flops(config: T5Config, encoder_tokens: int, decoder_tokens: int) -> tuple[int, int, int]:
    """Matmul FLOPs (2 per multiply-add) of one forward pass over one example: (one encoder block, one
    decoder block, the LM head).

    Encoder and decoder tokens are counted separately; cross-attention projects K and V from the encoder
    tokens; the LM head runs on decoder tokens. Attention scores count the full square (the causal half
    is computed anyway), as Megatron and PaLM do. Norms, softmax, activations and the embedding lookup
    are left out."""
    d, inner, d_ff = config.d_model, config.num_heads * config.d_kv, config.d_ff
    ffn_mats = 3 if config.is_gated_act else 2
    s, t = encoder_tokens, decoder_tokens

    def attention(q_tokens: int, kv_tokens: int) -> int:
        projections = 2 * q_tokens * d * inner * 2 + 2 * kv_tokens * d * inner * 2  # q, o  and  k, v
        scores = 2 * 2 * q_tokens * kv_tokens * inner  # q.k^T and probabilities.v
        return projections + scores

    def ffn(tokens: int) -> int:
        return 2 * tokens * d * d_ff * ffn_mats

    return attention(s, s) + ffn(s), attention(t, t) + attention(t, s) + ffn(t), 2 * t * d * config.vocab_size


def forward_flops_per_sample(config: T5Config, encoder_tokens: int, decoder_tokens: int) -> int:
    """Matmul FLOPs of one forward pass over one example (see block_forward_flops)."""
    encoder, decoder, head = block_forward_flops(config, encoder_tokens, decoder_tokens)
    return config.num_layers * encoder + config.num_decoder_layers * decoder + head


def training_flops_per_sample(config: T5Config, encoder_tokens: int, decoder_tokens: int) -> int:
    """Model FLOPs of a training step per example: forward + backward (twice the forward). Activation
    recomputation is not counted: MFU measures useful work (PaLM's definition)."""
    return 3 * forward_flops_per_sample(config, encoder_tokens, decoder_tokens)


# -- what a GPU can do --------------------------------------------------------------------------------------
# Dense peak FLOP/s without sparsity, from the vendors' data sheets. Keys are fragments of torch's device
# names (first match wins: "H100 PCIe" before "H100"): (bf16/fp16 tensor cores, fp32, tf32).
GPU_PEAKS = {
    "H200": (989e12, 67e12, 494e12), "H100 PCIe": (756e12, 51e12, 378e12), "H100": (989e12, 67e12, 494e12),
    "A100": (312e12, 19.5e12, 156e12), "A10G": (125e12, 31.2e12, 62.5e12), "L40S": (362e12, 91.6e12, 183e12),
    "L4": (121e12, 30.3e12, 60e12), "V100": (125e12, 15.7e12, 15.7e12), "RTX 4090": (165e12, 82.6e12, 82.6e12),
    "RTX 3090": (71e12, 35.6e12, 35.6e12), "T4": (65e12, 8.1e12, 8.1e12),
}

# The share of the dense peak a training step's matmuls are assumed to reach: the Model FLOPs Utilization
# Megatron-LM reports for a 530B GPT on 2240 A100s with sequence parallelism and selective recomputation
# (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
# arXiv:2205.05198, abstract: 54.2%). An end-to-end figure (their communication and pipeline bubble
# included), used here as the rate of computation alone, for every GPU and model size: large matmuls run
# at least this fast; a small model's matmuls run slower (its predictions are optimistic). Chosen before,
# and not fitted to, the published runs the planner is checked against (benchmarks/planner.md).
ACHIEVABLE_MFU = 0.542
ACHIEVABLE_MFU_SOURCE = ("Korthikanti et al. 2022 (arXiv:2205.05198): 54.2% MFU, 530B GPT, 2240 A100s, "
                         "Megatron-LM with sequence parallelism and selective recomputation")


@dataclass(frozen=True)
class GPUSpec:
    """One GPU as the planner sees it: peaks (GPU_PEAKS[peaks]), memory in bytes, and the bandwidth per GPU
    and direction, bytes/s, of its links inside a node (NVLink, or PCIe without it) and to other nodes (the
    NICs of its reference system, `gpus_per_node` GPUs, divided by its GPUs), each from the data sheets named
    in `source`; `bf16`: whether its tensor cores take bf16 (fp16 otherwise, with loss scaling)."""

    peaks: str
    memory: int
    intra_node: float
    inter_node: float
    gpus_per_node: int
    bf16: bool
    source: str


_GIB = 2**30  # HBM sizes on data sheets are binary: 80 GB of HBM hold 80 GiB
_A100 = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_DGX_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf"
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_DGX_H100 = "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html"
_V100 = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_DGX1 = "https://images.nvidia.com/content/pdf/dgx1-v100-system-architecture-whitepaper.pdf"
_NO_SYSTEM = "no reference system: one 100 Gb/s NIC per GPU assumed (set --inter-node-bandwidth)"

# Planner names (case-insensitive). NVLink figures on data sheets add both directions: halved here.
GPU_SPECS = {
    "H200": GPUSpec("H200", 141 * _GIB, 450e9, 50e9, 8, True,
                    "H200 SXM: 141 GB, NVLink 900 GB/s (https://www.nvidia.com/en-us/data-center/h200/); DGX "
                    "H200: 8x 400 Gb/s ConnectX-7 (https://www.nvidia.com/en-us/data-center/dgx-h200/)"),
    "H100": GPUSpec("H100", 80 * _GIB, 450e9, 50e9, 8, True,
                    f"H100 SXM5: 80 GB, NVLink 900 GB/s ({_H100}); DGX H100: 8x 400 Gb/s ConnectX-7 ({_DGX_H100})"),
    "H100-PCIE": GPUSpec("H100 PCIe", 80 * _GIB, 64e9, 12.5e9, 8, True,
                         f"H100 PCIe: 80 GB, PCIe Gen5 128 GB/s ({_H100}); {_NO_SYSTEM}"),
    "A100": GPUSpec("A100", 80 * _GIB, 300e9, 25e9, 8, True,
                    f"A100 SXM4 80GB: NVLink 600 GB/s ({_A100}); DGX A100: 8x 200 Gb/s HDR InfiniBand ({_DGX_A100})"),
    "A100-40GB": GPUSpec("A100", 40 * _GIB, 300e9, 25e9, 8, True,
                         f"A100 SXM4 40GB: NVLink 600 GB/s ({_A100}); DGX A100: 8x 200 Gb/s HDR ({_DGX_A100})"),
    "V100": GPUSpec("V100", 32 * _GIB, 150e9, 6.25e9, 8, False,
                    f"V100 SXM2 32GB: NVLink 300 GB/s ({_V100}); DGX-1: 4x 100 Gb/s EDR InfiniBand per 8 GPUs "
                    f"({_DGX1})"),
    "V100-16GB": GPUSpec("V100", 16 * _GIB, 150e9, 6.25e9, 8, False,
                         f"V100 SXM2 16GB: NVLink 300 GB/s ({_V100}); DGX-1: 4x 100 Gb/s EDR per 8 GPUs ({_DGX1})"),
    "L40S": GPUSpec("L40S", 48 * _GIB, 32e9, 12.5e9, 8, True,
                    "L40S: 48 GB, PCIe Gen4 x16 64 GB/s (https://www.nvidia.com/en-us/data-center/l40s/); "
                    + _NO_SYSTEM),
    "L4": GPUSpec("L4", 24 * _GIB, 32e9, 12.5e9, 8, True,
                  "L4: 24 GB, PCIe Gen4 x16 64 GB/s (https://www.nvidia.com/en-us/data-center/l4/); " + _NO_SYSTEM),
    "T4": GPUSpec("T4", 16 * _GIB, 16e9, 12.5e9, 8, False,
                  "T4: 16 GB, PCIe Gen3 x16 32 GB/s (https://www.nvidia.com/en-us/data-center/tesla-t4/); "
                  + _NO_SYSTEM),
}
