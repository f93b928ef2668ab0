"""Fast decoding: a static key/value cache and a decode step with fixed shapes, for `torch.compile`.

The model's own cache (models/t5.py, `KVCache`) grows by concatenation at every step, so every step has new
shapes, and all rows of a batch stand at the same position. Here each decoder layer's keys and values live in
buffers allocated once — self-attention [rows, heads, capacity, d_kv], cross-attention [rows, heads,
source capacity, d_kv] — the new position's keys are written in place at each row's own position, and the
attention reads the whole buffer with the positions after a row's own masked out. Shapes are then those of
the buffers only: `torch.compile` captures the step once per (rows, capacity, source capacity) bucket, and
rows may stand at different positions, which lets a server admit a request into the slot of a finished one
(serve/engine.py).

Masked positions get the dtype's minimum, as the model's masks do, so they weigh exactly 0 in the softmax;
the tokens equal the eager path's (models/generate.py, tested), up to the rounding of sums over more zeros.

Why hand-written: the step re-walks the decoder's blocks (calling their own layers) instead of calling
`T5Stack.forward`, because the model's forward computes the relative position bias and the masks for one
position shared by all rows, and extends its cache by concatenation; both would defeat fixed shapes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from t5forge.errors import ConfigError
from t5forge.models.t5 import T5ForConditionalGeneration, clamp_fp16, additive_mask, relative_position_bucket

MIN_BUCKET = 16  # the smallest capacity bucket (self-attention and source lengths)


def bucket(n: int, minimum: int = 1) -> int:
    """The power of two >= max(n, minimum): the shapes a compiled step is captured for."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


class StaticKVCache:
    """The decoder's keys and values in fixed buffers: `self_keys[i]`, `self_values[i]` [rows, heads,
    capacity, d_kv] (written at each row's position), `cross_keys[i]`, `cross_values[i]` [rows, heads,
    source_capacity, d_kv] (of the encoder output, written once per row), `cross_bias` [rows, 1, 1,
    source_capacity] (0 for the row's source tokens, the minimum for padding) and `positions` [rows], the
    position each row decodes next."""

    def __init__(self, model: T5ForConditionalGeneration, rows: int, capacity: int, source_capacity: int,
                 device: torch.device, dtype: torch.dtype):
        cfg = model.config
        heads, d_kv, blocks = cfg.num_heads, cfg.d_kv, len(model.decoder.block)

        def zeros(length: int) -> list[torch.Tensor]:
            return [torch.zeros(rows, heads, length, d_kv, device=device, dtype=dtype) for _ in range(blocks)]

        self.self_keys, self.self_values = zeros(capacity), zeros(capacity)
        self.cross_keys, self.cross_values = zeros(source_capacity), zeros(source_capacity)
        # Empty rows attend to their first source position only (a row of minima only would be as harmless).
        keep = torch.zeros(rows, source_capacity, dtype=torch.bool, device=device)
        keep[:, 0] = True
        self.cross_bias = additive_mask(keep[:, None, None, :], dtype)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.dtype = dtype
        if device.type == "cuda":  # CUDA graphs replay on these addresses: mutated in place, never copied
            for buffer in self.self_keys + self.self_values + self.cross_keys + self.cross_values:
                torch._dynamo.mark_static_address(buffer)

    @property
    def rows(self) -> int:
        return self.positions.shape[0]

    @property
    def capacity(self) -> int:
        return self.self_keys[0].shape[2]

    @property
    def source_capacity(self) -> int:
        return self.cross_keys[0].shape[2]

    @torch.no_grad()
    def fill_rows(self, model: T5ForConditionalGeneration, rows: torch.Tensor, encoded: torch.Tensor,
                  attention_mask: torch.Tensor | None) -> None:
        """Start rows `rows` [n] for new inputs: their cross-attention keys/values from `encoded` [n, source_len,
        d_model] (the encoder output; `attention_mask` [n, source_len] or None), position 0. Their old
        self-attention entries need no clearing: positions after a row's own are masked."""
        length = encoded.shape[1]
        if length > self.source_capacity:
            raise ConfigError(f"inputs of {length} tokens do not fit the cache's {self.source_capacity} source "
                              "positions; allocate a larger cache")
        for i, block in enumerate(model.decoder.block):
            attention = block.layer[1].EncDecAttention
            for projection, buffers in ((attention.k, self.cross_keys), (attention.v, self.cross_values)):
                states = _heads(projection(encoded), attention.d_kv).to(self.dtype)
                buffers[i][rows] = F.pad(states, (0, 0, 0, self.source_capacity - length))
        keep = torch.zeros(len(rows), self.source_capacity, dtype=torch.bool, device=encoded.device)
        keep[:, :length] = True if attention_mask is None else attention_mask.bool()
        self.cross_bias[rows] = additive_mask(keep[:, None, None, :], self.dtype)
        self.positions[rows] = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` of the self-attention buffers in place (beam search: the beams that go on; rows
        after len(index) keep their own). Cross-attention rows of one input's beams are equal already."""
        if len(index) < self.rows:
            index = torch.cat([index, torch.arange(len(index), self.rows, device=index.device)])
        for buffer in self.self_keys + self.self_values:
            buffer.copy_(buffer.index_select(0, index))

    def move_rows(self, source: torch.Tensor, target: "StaticKVCache") -> None:
        """Copy rows `source` [n] of this cache into rows 0..n-1 of `target` (a server changing batch bucket)."""
        n = len(source)
        for mine, theirs in zip(self.self_keys + self.self_values, target.self_keys + target.self_values):
            length = min(mine.shape[2], theirs.shape[2])
            theirs[:n, :, :length] = mine[source, :, :length]
        for mine, theirs in zip(self.cross_keys + self.cross_values, target.cross_keys + target.cross_values):
            length = min(mine.shape[2], theirs.shape[2])
            theirs[:n, :, :length] = mine[source, :, :length]
        length = min(self.source_capacity, target.source_capacity)
        target.cross_bias[:n, ..., :length] = self.cross_bias[source, ..., :length]
        target.positions[:n] = self.positions[source]


def _heads(x: torch.Tensor, d_kv: int) -> torch.Tensor:  # [b, len, h*d] -> [b, h, len, d]
    return x.view(x.shape[0], x.shape[1], -1, d_kv).transpose(1, 2)


def decode_step(model: T5ForConditionalGeneration, tokens: torch.Tensor, positions: torch.Tensor,
                self_keys: list[torch.Tensor], self_values: list[torch.Tensor], cross_keys: list[torch.Tensor],
                cross_values: list[torch.Tensor], cross_bias: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, vocab] of the position after `tokens` [rows, 1], which stand at `positions` [rows];
    their keys/values are written into the self-attention buffers there. Fixed shapes, no host reads: what
    `torch.compile` captures. The arithmetic of each layer is the model's (T5Attention, T5Block)."""
    cfg, decoder = model.config, model.decoder
    rows, capacity = tokens.shape[0], self_keys[0].shape[2]
    key_positions = torch.arange(capacity, device=tokens.device)
    future = key_positions[None, :] > positions[:, None]  # [rows, capacity]: not yet written (or stale)
    write_at = positions.view(rows, 1, 1, 1)
    hidden = model.shared(tokens)
    position_bias = None
    for i, block in enumerate(decoder.block):
        layer = block.layer[0]
        attention = layer.SelfAttention
        if attention.has_relative_attention_bias:  # the first block (T5, mT5) or every block (UMT5)
            buckets = relative_position_bucket(key_positions[None, :] - positions[:, None], bidirectional=False,
                                               num_buckets=attention.num_buckets, max_distance=attention.max_distance)
            bias = attention.relative_attention_bias(buckets).permute(0, 2, 1).unsqueeze(2)  # [rows, h, 1, cap]
            position_bias = bias.masked_fill(future[:, None, None, :], torch.finfo(bias.dtype).min)
        query, key, value = (_heads(x, attention.d_kv) for x in attention.self_projections(layer.layer_norm(hidden)))
        for new, buffers in ((key, self_keys), (value, self_values)):
            buffers[i].scatter_(2, write_at.expand_as(new), new.to(buffers[i].dtype))
        out = F.scaled_dot_product_attention(query, self_keys[i], self_values[i],
                                             attn_mask=position_bias.to(query.dtype), scale=1.0)
        hidden = clamp_fp16(hidden + attention.o(out.transpose(1, 2).reshape(rows, 1, -1)))

        layer = block.layer[1]
        attention = layer.EncDecAttention
        query = _heads(attention.q(layer.layer_norm(hidden)), attention.d_kv)
        out = F.scaled_dot_product_attention(query, cross_keys[i], cross_values[i],
                                             attn_mask=cross_bias.to(query.dtype), scale=1.0)
        hidden = clamp_fp16(hidden + attention.o(out.transpose(1, 2).reshape(rows, 1, -1)))
        hidden = clamp_fp16(block.layer[-1](hidden))
    hidden = decoder.final_layer_norm(hidden)
    if cfg.scale_decoder_outputs:
        hidden = hidden * (cfg.d_model**-0.5)
    return model.lm_head(hidden)[:, -1, :].float()


class DecodeStep(nn.Module):
    """`decode_step` of a model, as a module: compiled as one, its weights are the module's attributes, which
    lets inductor's freezing treat them as constants (prepacked for oneDNN on the CPU)."""

    def __init__(self, model: T5ForConditionalGeneration):
        super().__init__()
        self.model = model

    def forward(self, *args) -> torch.Tensor:
        return decode_step(self.model, *args)


def step_function(model: T5ForConditionalGeneration, compile: bool = False) -> Callable[..., torch.Tensor]:
    """`decode_step` bound to `model`; with `compile`, through `torch.compile` (CUDA graphs on GPU: mode
    reduce-overhead), captured once per (rows, capacity, source capacity) bucket and kept with the model for
    its later calls. On GPUs each new cache's buffers are new addresses to the CUDA graphs (not verified on a
    GPU here)."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError("the static-cache decoder runs an unsharded model; a sharded one (--tp) decodes with "
                          "the eager path (drop --compile)")
    if not compile:
        return DecodeStep(model)
    compiled = model.__dict__.get("_compiled_decode_step")
    if compiled is None:
        on_gpu = next(model.parameters()).device.type == "cuda"
        # On the CPU, freezing lets inductor treat the weights as constants and prepack them for oneDNN
        # (2.3x faster for an lm_head at one row): the compiled step serves inference only, for the weights
        # it was compiled with.
        step = torch.compile(DecodeStep(model), dynamic=False, mode="reduce-overhead" if on_gpu else None,
                             options=None if on_gpu else {"freezing": True})

        # One capture per (rows, capacity, source capacity) bucket: more than dynamo's default limit of 8 per
        # function, raised for these calls only (the setting's name before torch 2.6: cache_size_limit).
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"

        def compiled(*args):
            with torch._dynamo.config.patch(**{limit: 64}):
                return step(*args)

        # Kept in the instance's own dict, not registered as a submodule: no second entry in the state dict.
        model.__dict__["_compiled_decode_step"] = compiled
    return compiled


class StaticDecoder:
    """models/generate.py's decoder interface (`next_logits`, `cache.reorder`) over a StaticKVCache: the
    encoder runs once on the inputs as given; rows (inputs x beams) are padded to a power of two, the
    self-attention capacity to one >= the longest output, the source to one >= the inputs' length."""

    def __init__(self, model: T5ForConditionalGeneration, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, rows_per_input: int, max_length: int, compile: bool):
        self.model = model
        self.step = step_function(model, compile)
        encoded = model.encode(input_ids, attention_mask).repeat_interleave(rows_per_input, dim=0)
        mask = None if attention_mask is None else attention_mask.repeat_interleave(rows_per_input, dim=0)
        self.rows = encoded.shape[0]
        self.cache = StaticKVCache(model, bucket(self.rows), bucket(max_length, MIN_BUCKET),
                                   bucket(encoded.shape[1], MIN_BUCKET), encoded.device, encoded.dtype)
        self.cache.fill_rows(model, torch.arange(self.rows, device=encoded.device), encoded, mask)

    def next_logits(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the position after `last_tokens` [rows, 1]."""
        c = self.cache
        tokens = F.pad(last_tokens, (0, 0, 0, c.rows - self.rows), value=self.model.config.pad_token_id)
        logits = self.step(tokens, c.positions, c.self_keys, c.self_values, c.cross_keys, c.cross_values,
                           c.cross_bias)
        c.positions += 1
        return logits[:self.rows]
