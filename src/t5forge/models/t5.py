"""The T5 family in one file: T5 v1.0, T5 v1.1 / Flan-T5, mT5 and UMT5.

Read top to bottom: config, norm, attention with relative position bias, feed-forward, block, stack,
the conditional-generation wrapper. Parameter names are HuggingFace's (`shared`,
`encoder.block.N.layer.0.SelfAttention.q`, ...), so checkpoints map one-to-one.

There is no parallelism here: tensor/data/pipeline parallelism and activation checkpointing are applied
to this plain model from outside (t5forge.parallel).

Variants are selected by config, not by copies of the code:
- `feed_forward_proj`: "relu" (v1.0, one `wi`) or "gated-gelu" (v1.1 / mT5 / UMT5: `wi_0`, `wi_1`).
- `tie_word_embeddings`: the LM head reuses `shared.weight` (v1.0) or has its own `lm_head.weight`.
- `scale_decoder_outputs`: multiply the decoder output by d_model**-0.5 before the head (v1.0 only).
- `relative_bias_per_layer`: every self-attention owns a relative position bias (UMT5) instead of the
  first layer of each stack computing it once for all layers (T5, mT5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from t5forge.errors import ConfigError
from t5forge.models.loss import linear_cross_entropy_sum, token_loss_sum

MODEL_TYPES = ("t5", "mt5", "umt5")


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Mesh TF's, used by every gated T5), written as HF writes it:
    the fused F.gelu(approximate="tanh") rounds differently (5e-6 on T5 v1.1-small logits), and this
    form makes fp32 outputs bit-identical to transformers'. torch.compile fuses it on GPU."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_pytorch_tanh(x: torch.Tensor) -> torch.Tensor:
    """The same tanh-approximated GELU in one fused kernel (forward and backward): 2.8 instead of 13.7 ms
    forward + backward at [4, 512, 1024] on a 2-core CPU."""
    return F.gelu(x, approximate="tanh")


# Activation names as HF's ACT2FN spells them.
_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": gelu_new,
    "gelu_pytorch_tanh": gelu_pytorch_tanh,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass
class T5Config:
    """Architecture of one T5-family model. Field names and meanings are those of HF's config.json."""

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64  # per-head size; need not equal d_model / num_heads
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None  # None: same as num_layers
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    initializer_factor: float = 1.0
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool | None = None  # None: same as tie_word_embeddings
    model_type: str = "t5"
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0
    # config.json keys this class does not model (task_specific_params, ...), kept so exports carry them.
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.scale_decoder_outputs is None:
            self.scale_decoder_outputs = self.tie_word_embeddings
        self.validate()

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def dense_act_fn(self) -> str:
        act = self.feed_forward_proj.split("-")[-1]
        # HF keeps "gated-gelu" meaning the tanh approximation, for compatibility with v1.1 checkpoints.
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else act

    @property
    def relative_bias_per_layer(self) -> bool:
        return self.model_type == "umt5"

    def validate(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not a T5-family architecture; "
                f"expected one of {', '.join(MODEL_TYPES)}"
            )
        parts = self.feed_forward_proj.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated") or self.dense_act_fn not in _ACTIVATIONS:
            raise ConfigError(
                f"feed_forward_proj {self.feed_forward_proj!r} is not supported; use 'relu', 'gated-gelu' "
                f"or '[gated-]ACT' with ACT in {sorted(_ACTIVATIONS)}"
            )
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
                     "relative_attention_num_buckets", "relative_attention_max_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ConfigError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}


class T5LayerNorm(nn.Module):
    """T5's norm: RMSNorm without mean or bias; the variance is accumulated in fp32 for half inputs."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Mesh TF's bucketing of (key position - query position): exact buckets for small distances,
    logarithmically wider ones up to `max_distance`, one last bucket beyond. Decoder (unidirectional)
    attention only distinguishes distances into the past."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.clamp(if_large, max=num_buckets - 1)
    return buckets + torch.where(is_small, relative_position, if_large)


class T5Attention(nn.Module):
    """Multi-head attention without 1/sqrt(d) scaling; position information enters as an additive bias."""

    def __init__(self, config: T5Config, has_relative_attention_bias: bool, is_decoder: bool):
        super().__init__()
        self.n_heads = config.num_heads
        self.d_kv = config.d_kv
        self.is_decoder = is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.dropout = config.dropout_rate
        inner_dim = config.num_heads * config.d_kv
        self.q = nn.Linear(config.d_model, inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, inner_dim, bias=False)
        self.o = nn.Linear(inner_dim, config.d_model, bias=False)
        # q, k and v of self-attention as one matmul, returning the three: set for inference only
        # (models/optimize.py, which then drops q, k, v); training keeps the three layers HF names.
        self.fused_qkv: nn.Module | None = None
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, self.n_heads)

    def compute_bias(self, query_length: int, key_length: int, query_offset: int = 0) -> torch.Tensor:
        """Relative position bias [1, heads, query_length, key_length]. `query_offset` is the position of
        the first query (non-zero when decoding one token at a time)."""
        device = self.relative_attention_bias.weight.device
        query_pos = torch.arange(query_length, dtype=torch.long, device=device)[:, None] + query_offset
        key_pos = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(
            key_pos - query_pos,
            bidirectional=not self.is_decoder,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        values = self.relative_attention_bias(buckets)  # [q, k, heads]
        return values.permute(2, 0, 1).unsqueeze(0)

    def self_projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention's queries, keys and values [batch, len, heads * d_kv] of `hidden_states`."""
        if self.fused_qkv is not None:
            return self.fused_qkv(hidden_states)
        return self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attn_bias: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        """hidden_states [batch, q_len, d_model]; key_value_states [batch, k_len, d_model] for
        cross-attention; attn_bias broadcastable to [batch, heads, q_len, k_len] (position bias + mask).
        `cache` (generation, see KVCache) keeps this layer's keys and values: self-attention appends the new
        positions' to those of the earlier steps, cross-attention computes them once."""
        batch, q_len, _ = hidden_states.shape

        def heads(x: torch.Tensor) -> torch.Tensor:  # [b, len, h*d] -> [b, h, len, d]
            # The head count comes from the tensor: under tensor parallelism a rank holds h / tp heads.
            return x.view(batch, x.shape[1], -1, self.d_kv).transpose(1, 2)

        if key_value_states is None:  # self-attention
            query, key, value = (heads(x) for x in self.self_projections(hidden_states))
            if cache is not None:
                if cache.key is not None:
                    key, value = torch.cat([cache.key, key], dim=2), torch.cat([cache.value, value], dim=2)
                cache.key, cache.value = key, value
        else:
            query = heads(self.q(hidden_states))
            if cache is not None and cache.key is not None:
                key, value = cache.key, cache.value
            else:
                key, value = heads(self.k(key_value_states)), heads(self.v(key_value_states))
                if cache is not None:
                    cache.key, cache.value = key, value
        if attn_bias is not None:
            attn_bias = attn_bias.to(query.dtype)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_bias,
            dropout_p=self.dropout if self.training else 0.0, scale=1.0,
        )
        out = out.transpose(1, 2).reshape(batch, q_len, -1)
        return self.o(out)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias: bool, is_decoder: bool):
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias, is_decoder)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor, attn_bias: torch.Tensor | None,
                cache: AttentionCache | None = None) -> torch.Tensor:
        attended = self.SelfAttention(self.layer_norm(hidden_states), attn_bias, cache=cache)
        return hidden_states + self.dropout(attended)


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config: T5Config):
        super().__init__()
        self.EncDecAttention = T5Attention(config, has_relative_attention_bias=False, is_decoder=True)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(
        self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, attn_bias: torch.Tensor | None,
        cache: AttentionCache | None = None,
    ) -> torch.Tensor:
        attended = self.EncDecAttention(self.layer_norm(hidden_states), attn_bias, encoder_hidden_states,
                                        cache=cache)
        return hidden_states + self.dropout(attended)


def linear_input_dtype(linear: nn.Module) -> torch.dtype:
    """The dtype a linear layer computes in: its weight's, or what a layer prepared for inference
    (models/optimize.py: prepacked or int8 weights) names."""
    return getattr(linear, "input_dtype", None) or linear.weight.dtype


class T5DenseActDense(nn.Module):
    """v1.0 feed-forward: wo(act(wi(x)))."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = _ACTIVATIONS[config.dense_act_fn]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.act(self.wi(hidden_states)))
        # Checkpoints may keep `wo` in fp32 while the rest is half (HF does so for Flan-T5-XXL).
        return self.wo(hidden_states.to(linear_input_dtype(self.wo)))


class T5DenseGatedActDense(nn.Module):
    """v1.1 / mT5 / UMT5 feed-forward: wo(act(wi_0(x)) * wi_1(x))."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = _ACTIVATIONS[config.dense_act_fn]
        # wi_0 and wi_1 as one matmul returning the two: inference only (models/optimize.py), as T5Attention's.
        self.fused_wi: nn.Module | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.fused_wi is not None:
            gate, up = self.fused_wi(hidden_states)
        else:
            gate, up = self.wi_0(hidden_states), self.wi_1(hidden_states)
        hidden_states = self.act(gate) * up
        hidden_states = self.dropout(hidden_states)
        return self.wo(hidden_states.to(linear_input_dtype(self.wo)))


class T5LayerFF(nn.Module):
    def __init__(self, config: T5Config):
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(config) if config.is_gated_act else T5DenseActDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.dropout(self.DenseReluDense(self.layer_norm(hidden_states)))


def clamp_fp16(hidden_states: torch.Tensor) -> torch.Tensor:
    # As HF: keep fp16 activations finite so fp16 training of large T5s does not overflow into inf.
    if hidden_states.dtype != torch.float16:
        return hidden_states
    finfo = torch.finfo(torch.float16)
    clamp_value = torch.where(torch.isinf(hidden_states).any(), finfo.max - 1000, finfo.max)
    return torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)


class T5Block(nn.Module):
    """layer[0] self-attention, layer[1] cross-attention (decoder only), layer[-1] feed-forward."""

    def __init__(self, config: T5Config, has_relative_attention_bias: bool, is_decoder: bool):
        super().__init__()
        self.is_decoder = is_decoder
        self.layer = nn.ModuleList([T5LayerSelfAttention(config, has_relative_attention_bias, is_decoder)])
        if is_decoder:
            self.layer.append(T5LayerCrossAttention(config))
        self.layer.append(T5LayerFF(config))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_bias: torch.Tensor | None,
        mask: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor | None = None,
        cross_attn_bias: torch.Tensor | None = None,
        cache: BlockCache | None = None,
        past_length: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the new hidden states and the self-attention bias (position bias + mask) that the
        following blocks reuse. A block with its own relative position bias (the first of each stack in
        T5, every block in UMT5) computes it here, inside its own forward, where sharded parameters are
        gathered. In generation, `cache` holds the block's keys and values and the queries start at
        position `past_length`: the bias is that of the new positions only."""
        attention = self.layer[0].SelfAttention
        if attention.has_relative_attention_bias:
            length = hidden_states.shape[1]
            position_bias = attention.compute_bias(length, past_length + length, query_offset=past_length)
            if mask is not None:
                position_bias = position_bias + mask
            # Cast once for every block of the stack, to the dtype of the attention's queries (autocast's):
            # a cast per layer would copy [batch, heads, len, len] each time, forward and backward.
            position_bias = position_bias.to(compute_dtype(hidden_states))
        self_cache, cross_cache = (None, None) if cache is None else (cache.self, cache.cross)
        hidden_states = clamp_fp16(self.layer[0](hidden_states, position_bias, self_cache))
        if self.is_decoder:
            hidden_states = clamp_fp16(self.layer[1](hidden_states, encoder_hidden_states, cross_attn_bias,
                                                      cross_cache))
        return clamp_fp16(self.layer[-1](hidden_states)), position_bias


def compute_dtype(hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype that linear layers produce from `hidden_states`: autocast's when it is on."""
    device = hidden_states.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden_states.dtype


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean "may attend" mask -> additive float mask (0 where allowed, the dtype's minimum elsewhere)."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


class AttentionCache:
    """One attention layer's cached keys and values, [batch, heads, len, d_kv] each (None before the first
    step). Plain objects rather than dicts: what wraps a block may rebuild the containers among its inputs
    (FSDP2 casting floating inputs under mixed precision does), and the layer's writes into a copy would be
    lost."""

    def __init__(self):
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None


class BlockCache:
    def __init__(self):
        self.self, self.cross = AttentionCache(), AttentionCache()


class KVCache:
    """The decoder's keys and values kept between generation steps, filled by the attention layers: per
    block, self-attention's grow by the positions of each step, cross-attention's (of the encoder output)
    are computed at the first step. `length`: the positions cached so far."""

    def __init__(self, num_blocks: int):
        self.blocks = [BlockCache() for _ in range(num_blocks)]
        self.length = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` of the self-attention cache (beam search: the beams that go on). The
        cross-attention rows of one input's beams are equal, so they need no reordering."""
        for block in self.blocks:
            if block.self.key is not None:
                block.self.key = block.self.key.index_select(0, index)
                block.self.value = block.self.value.index_select(0, index)


class T5Stack(nn.Module):
    """The encoder or the decoder: blocks over already-embedded inputs, then the final norm.

    The embedding lives in the parent model (`shared`) and is passed in, so the stack has no copy of it."""

    def __init__(self, config: T5Config, is_decoder: bool):
        super().__init__()
        self.is_decoder = is_decoder
        num_blocks = config.num_decoder_layers if is_decoder else config.num_layers
        self.block = nn.ModuleList(
            T5Block(config, has_relative_attention_bias=config.relative_bias_per_layer or i == 0,
                    is_decoder=is_decoder)
            for i in range(num_blocks)
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def attention_masks(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None = None, past_length: int = 0,
        segment_ids: torch.Tensor | None = None, encoder_segment_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Additive masks in the dtype of `hidden_states` [batch, len, d_model]: self-attention [batch or 1, 1,
        len or 1, past_length + len] (padding, and causality in the decoder; `attention_mask` covers every
        key) and cross-attention [batch, 1, 1 or len, source_len].

        Packed rows (several examples per row) give `segment_ids` [batch, len] (and in the decoder
        `encoder_segment_ids` [batch, source_len]): 1, 2, ... per example, 0 for padding; a position then
        sees only the positions of its own example (padding sees padding, so that no row of the softmax is
        empty). Relative position biases depend only on distances, so an example's attention is the same
        packed or alone."""
        length, dtype, device = hidden_states.shape[1], hidden_states.dtype, hidden_states.device
        # Which keys each query may see, True = attend.
        keep = None
        if segment_ids is not None:
            keep = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        elif attention_mask is not None:
            keep = attention_mask.bool()[:, None, None, :]
        if self.is_decoder and length > 1:  # (a single new position sees every earlier one: nothing to mask)
            causal = torch.ones(length, past_length + length, dtype=torch.bool, device=device)
            causal = causal.tril(diagonal=past_length)[None, None]
            keep = causal if keep is None else keep & causal
        mask = None if keep is None else additive_mask(keep, dtype)
        cross_bias = None
        if self.is_decoder and segment_ids is not None and encoder_segment_ids is not None:
            cross_bias = additive_mask(segment_ids[:, None, :, None] == encoder_segment_ids[:, None, None, :], dtype)
        elif self.is_decoder and encoder_attention_mask is not None:
            cross_bias = additive_mask(encoder_attention_mask.bool()[:, None, None, :], dtype)
        return mask, cross_bias

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        segment_ids: torch.Tensor | None = None,
        encoder_segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [batch, len, d_model]; masks [batch, len] with 1 for real tokens, 0 for padding.
        With a `cache` (generation: decoder only), inputs_embeds are the positions after those cached.
        Segment ids: packed rows (see attention_masks)."""
        past = 0 if cache is None else cache.length
        mask, cross_bias = self.attention_masks(inputs_embeds, attention_mask, encoder_attention_mask, past,
                                                segment_ids, encoder_segment_ids)
        hidden_states = self.dropout(inputs_embeds)
        # T5/mT5: the first block's bias is reused by every block; UMT5: each block computes its own.
        position_bias = None
        for i, block in enumerate(self.block):
            hidden_states, position_bias = block(hidden_states, position_bias, mask, encoder_hidden_states,
                                                 cross_bias, None if cache is None else cache.blocks[i], past)
        if cache is not None:
            cache.length += inputs_embeds.shape[1]
        return self.dropout(self.final_layer_norm(hidden_states))


def use_fused_gelu(model: nn.Module) -> None:
    """Run every feed-forward's `gelu_new` as `gelu_pytorch_tanh`: the same function, rounded differently
    (transformers keeps the op-by-op form for gated-gelu checkpoints), several times faster."""
    for module in model.modules():
        if isinstance(module, (T5DenseActDense, T5DenseGatedActDense)) and module.act is gelu_new:
            module.act = gelu_pytorch_tanh


def stacks(model: nn.Module) -> list[T5Stack]:
    """The encoder and the decoder of a model, or those of them that a pipeline stage holds."""
    return [stack for stack in (getattr(model, "encoder", None), getattr(model, "decoder", None)) if stack is not None]


def named_blocks(stack: T5Stack) -> list[tuple[int, nn.Module]]:
    """(index, block) of the blocks a stack runs, in order. A pipeline stage's stack holds only its own
    blocks, keyed by index in an nn.ModuleDict, and may keep block 0 only for its relative position
    bias table (a block without its sub-layers, never run: not listed here)."""
    items = stack.block.items() if isinstance(stack.block, nn.ModuleDict) else enumerate(stack.block)
    complete = 3 if stack.is_decoder else 2
    return [(int(i), block) for i, block in items if len(block.layer) == complete]


class T5LMHead(nn.Linear):
    """The LM head: nn.Linear(d_model, vocab_size, bias=False), HF's `lm_head.weight`. Given `labels`
    [batch, target_len], it returns the summed token loss instead of logits, fused with the projection
    (models/loss.py: the logits of the whole batch never exist). The fused loss is a call of this module
    too, so what is applied to the head from outside (FSDP's gathering of a sharded weight) serves it."""

    def __init__(self, config: T5Config):
        super().__init__(config.d_model, config.vocab_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [batch, len, d_model] -> logits [batch, len, vocab], or with labels the loss sum []."""
        if labels is None:
            return super().forward(hidden_states)
        return linear_cross_entropy_sum(hidden_states, self.weight, labels)


@dataclass
class Seq2SeqLMOutput:
    """Batch-first outputs. `loss` is the mean cross-entropy over labels != -100, `loss_sum` their sum."""

    logits: torch.Tensor | None  # [batch, target_len, vocab]; None when the loss was fused with the head
    loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    encoder_last_hidden_state: torch.Tensor | None = None  # [batch, source_len, d_model]


class T5ForConditionalGeneration(nn.Module):
    """Encoder-decoder T5 with a language-modelling head, HF's forward signature and outputs. Its HF-style
    `generate`, `save_pretrained` and `from_pretrained` live with their code (generate.py, hf.py, which build
    on this file) and are attached to the class by the package (models/__init__.py)."""

    def __init__(self, config: T5Config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, is_decoder=False)
        self.decoder = T5Stack(config, is_decoder=True)
        self.lm_head = T5LMHead(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight

    # -- construction ----------------------------------------------------------------------------------
    def init_plan(self) -> list[tuple[nn.Parameter, str, float]]:
        """Mesh TF / T5X initialisation as an ordered list of (parameter, "normal" | "fill", std or value):
        HF's `_init_weights`, except that an untied `lm_head` gets std d_model**-0.5 instead of 1.0, so that
        pretraining from scratch starts near loss ln(vocab). The order fixes the random stream: whoever
        applies the plan (here, or t5forge.parallel on sharded parameters) draws the same numbers."""
        cfg, factor = self.config, self.config.initializer_factor
        plan = [(self.shared.weight, "normal", factor * 1.0)]
        if not cfg.tie_word_embeddings:
            plan.append((self.lm_head.weight, "normal", factor * cfg.d_model**-0.5))
        for module in self.modules():
            if isinstance(module, T5LayerNorm):
                plan.append((module.weight, "fill", factor))
            elif isinstance(module, T5Attention):
                plan += [(module.q.weight, "normal", factor * (cfg.d_model * cfg.d_kv) ** -0.5),
                         (module.k.weight, "normal", factor * cfg.d_model**-0.5),
                         (module.v.weight, "normal", factor * cfg.d_model**-0.5),
                         (module.o.weight, "normal", factor * (cfg.num_heads * cfg.d_kv) ** -0.5)]
                if module.has_relative_attention_bias:
                    plan.append((module.relative_attention_bias.weight, "normal", factor * cfg.d_model**-0.5))
            elif isinstance(module, (T5DenseActDense, T5DenseGatedActDense)):
                inputs = [module.wi] if isinstance(module, T5DenseActDense) else [module.wi_0, module.wi_1]
                plan += [(linear.weight, "normal", factor * cfg.d_model**-0.5) for linear in inputs]
                plan.append((module.wo.weight, "normal", factor * cfg.d_ff**-0.5))
        return plan

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every parameter in place (see `init_plan`). Values are drawn on the CPU, so a model on
        any device starts from the same weights for the same generator seed."""
        for param, kind, value in self.init_plan():
            if kind == "fill":
                param.fill_(value)
            else:
                param.copy_(torch.empty(param.shape, dtype=param.dtype).normal_(0.0, value, generator=generator))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied head counts once)."""
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            params.pop(id(self.shared.weight), None)
            params.pop(id(self.lm_head.weight), None)
        return sum(p.numel() for p in params.values())

    # -- forward ---------------------------------------------------------------------------------------
    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs from labels: prepend decoder_start_token_id, drop the last label, and replace
        ignored positions (-100) by the pad id, as HF does."""
        shifted = labels.new_full(labels.shape, self.config.decoder_start_token_id)
        shifted[..., 1:] = labels[..., :-1]
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [batch, source_len] -> encoder states [batch, source_len, d_model]."""
        return self.encoder(self.shared(input_ids), attention_mask, segment_ids=segment_ids)

    def decoder_output(
        self,
        decoder_input_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        encoder_segment_ids: torch.Tensor | None = None,
        decoder_segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What the LM head projects: decoder states [batch, target_len, d_model] (with a `cache`: of the
        positions after those cached; see models/generate.py)."""
        hidden_states = self.decoder(
            self.shared(decoder_input_ids), decoder_attention_mask, encoder_hidden_states, attention_mask, cache,
            decoder_segment_ids, encoder_segment_ids,
        )
        if self.config.scale_decoder_outputs:
            # Mesh TF rescales before projecting with the (tied) embedding matrix.
            hidden_states = hidden_states * (self.config.d_model**-0.5)
        return hidden_states

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool = True,
        encoder_segment_ids: torch.Tensor | None = None,
        decoder_segment_ids: torch.Tensor | None = None,
    ) -> Seq2SeqLMOutput:
        """input_ids [batch, source_len]; labels [batch, target_len] with -100 for ignored positions.
        Without decoder_input_ids, they are labels shifted right. `return_logits=False` (with labels, for
        training) fuses the head with the loss (models/loss.py): equal up to float rounding, and the logits
        of the whole batch never exist. Packed rows (several examples each) give both segment ids
        [batch, source_len] / [batch, target_len] (1, 2, ... per example, 0 for padding) and their own
        decoder_input_ids (each example's targets shifted right on their own)."""
        if (encoder_segment_ids is None) != (decoder_segment_ids is None):
            raise ValueError("packed rows need both encoder_segment_ids and decoder_segment_ids")
        if decoder_segment_ids is not None and decoder_input_ids is None:
            raise ValueError("packed rows need their decoder_input_ids (shifting the whole row would join examples)")
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("pass decoder_input_ids or labels (decoder inputs are derived from labels)")
            decoder_input_ids = self.shift_right(labels)
        if not return_logits and labels is None:
            raise ValueError("return_logits=False returns only the loss: pass labels")
        encoder_hidden_states = self.encode(input_ids, attention_mask, encoder_segment_ids)
        hidden_states = self.decoder_output(decoder_input_ids, encoder_hidden_states, attention_mask,
                                            decoder_attention_mask, None, encoder_segment_ids, decoder_segment_ids)
        logits = loss = loss_sum = None
        if return_logits:
            logits = self.lm_head(hidden_states)
        if labels is not None:
            if return_logits:
                loss_sum = token_loss_sum(logits, labels)
            else:
                loss_sum = self.lm_head(hidden_states, labels=labels)
            loss = loss_sum / (labels != -100).sum()
        return Seq2SeqLMOutput(logits=logits, loss=loss, loss_sum=loss_sum,
                               encoder_last_hidden_state=encoder_hidden_states)
