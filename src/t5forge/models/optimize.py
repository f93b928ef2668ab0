"""A loaded model made fast for inference, in place: `optimize_for_inference(model, dtype)`.

- "fp32" on the CPU: every linear layer's weight prepacked into oneDNN's blocked layout once
  (`PackedLinear`), instead of aten's matmul re-reading the plain layout at each call. Measured on 2 EPYC
  cores: an lm_head 512 x 32128 at 8 rows 10.6 -> 2.5 ms, 512 x 250112 at 8 rows 90 -> 17 ms; the same
  numbers up to float rounding. Packed for 32 rows, which measured fastest for every batch of 1 to 32.
- "int8" on the CPU: dynamic quantization (`Int8Linear`: int8 weights per output channel, activations
  quantized per call; fbgemm's kernels through torch.ao's dynamic Linear). 4x smaller weights.
- "bf16" / "fp16": the model cast (GPU inference; bf16 runs on the CPU too, slowly without AMX).

The model then serves inference only: packed layers keep no trainable parameter. Why written here: inductor
packs weights only under torch.compile with freezing, which did not fire for these graphs (torch 2.13);
the ops it would call are used directly."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from t5forge.errors import ConfigError

DTYPES = ("fp32", "bf16", "fp16", "int8")
PACK_ROWS = 32


class PackedLinear(nn.Module):
    """y = x W^T (+ b) with W prepacked for oneDNN (CPU, fp32)."""

    input_dtype = torch.float32  # what T5's feed-forward casts its `wo` input to (models/t5.py)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().float(), PACK_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """Dynamically quantized linear layer: int8 weights (symmetric, one scale per output channel)."""

    input_dtype = torch.float32

    def __init__(self, linear: nn.Linear):
        super().__init__()
        from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        plain = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        plain.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        if linear.bias is not None:
            plain.bias = nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        plain.qconfig = per_channel_dynamic_qconfig
        with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
            warnings.simplefilter("ignore")
            self.quantized = DynamicQuantizedLinear.from_float(plain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x)


def _swap_linears(model: nn.Module, make) -> int:
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))
                swapped += 1
    return swapped


def optimize_for_inference(model: nn.Module, dtype: str = "fp32") -> nn.Module:
    """`model` (eval mode, unsharded) prepared for inference in `dtype` (see the module's docstring), in
    place; returned for convenience. A sharded model (tensor parallel) is left as it is for fp32."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown inference dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    device = next(model.parameters()).device
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    model.eval()
    if dtype in ("bf16", "fp16"):
        return model.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    if dtype == "int8":
        if device.type != "cpu" or sharded:
            raise ConfigError("--dtype int8 is CPU inference of an unsharded model; on GPUs use --dtype bf16")
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise ConfigError("--dtype int8 needs fbgemm's int8 kernels, which this torch build lacks; use fp32")
        _swap_linears(model, Int8Linear)
    elif device.type == "cpu" and not sharded and torch.backends.mkldnn.is_available():
        _swap_linears(model, PackedLinear)
    return model
