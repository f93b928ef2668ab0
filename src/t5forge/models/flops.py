"""FLOPs of the T5 family, the one formula: read by the training metrics (MFU), the benchmarks and the
pipeline balance."""

from __future__ import annotations

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
