"""Micro-benchmarks behind benchmarks/README.md: each candidate speed change of the T5 step, forward +
backward at the tensor sizes of the 4+4-layer d_model-256 benchmark (batch 4, 512 -> 114 tokens), the way
transformers computes it against the alternative, on this machine, with the largest difference of the
outputs (0: bit-identical).

    PYTHONPATH=src python scripts/speed_probes.py

The end-to-end effect of the changes that were adopted is measured by `t5forge bench` (train.fused_loss,
train.fused_gelu, train.compile); this script says why the others were not."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from t5forge.models.loss import linear_cross_entropy_sum

B, S, T, D, H, DKV, FF, V = 4, 512, 114, 256, 4, 64, 1024, 32128


def best_ms(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]  # the median


def leaf(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).requires_grad_()


def probe_qkv():
    x, wq, wk, wv = leaf(B * S, D), leaf(D, D), leaf(D, D), leaf(D, D)
    three = lambda: torch.cat([F.linear(x, w) for w in (wq, wk, wv)], -1)  # noqa: E731
    fused = lambda: F.linear(x, torch.cat([wq, wk, wv]))  # noqa: E731
    return "q, k, v as one [256, 768] projection", three, fused


def probe_gate_up():
    x, w0, w1 = leaf(B * S, D), leaf(FF, D), leaf(FF, D)
    two = lambda: F.linear(x, w0) * F.linear(x, w1)  # noqa: E731

    def fused():
        gate, up = F.linear(x, torch.cat([w0, w1])).chunk(2, -1)
        return gate * up

    return "wi_0 and wi_1 as one [256, 2048] projection", two, fused


def probe_norm():
    x, w = leaf(B, S, D), torch.ones(D, requires_grad=True)

    def t5(x=x):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    return "T5LayerNorm as F.rms_norm", t5, lambda: F.rms_norm(x, (D,), w, 1e-6)


def probe_gelu():
    x = leaf(B, S, FF)
    new = lambda: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))  # noqa
    return "gelu_new as F.gelu(approximate='tanh') (train.fused_gelu)", new, lambda: F.gelu(x, approximate="tanh")


def probe_attention():
    q, k, v, bias = leaf(B, H, S, DKV), leaf(B, H, S, DKV), leaf(B, H, S, DKV), leaf(1, H, S, S)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)  # noqa: E731

    def explicit():
        scores = torch.baddbmm(bias.expand(B, H, S, S).reshape(B * H, S, S), q.reshape(B * H, S, DKV),
                               k.reshape(B * H, S, DKV).transpose(1, 2))
        return torch.bmm(scores.softmax(-1), v.reshape(B * H, S, DKV)).view(B, H, S, DKV)

    return "self-attention with a trained position bias: explicit baddbmm instead of SDPA", sdpa, explicit


def probe_head_loss():
    hidden, weight = leaf(B, T, D), leaf(V, D, scale=D**-0.5)
    labels = torch.randint(0, V, (B, T))

    def logits():
        out = F.linear(hidden, weight).reshape(-1, V).float()
        return F.cross_entropy(out, labels.reshape(-1), reduction="sum")

    return "LM head + cross-entropy fused in token chunks (train.fused_loss)", logits, \
        lambda: linear_cross_entropy_sum(hidden, weight, labels)


def main() -> None:
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| change | as transformers, ms | changed, ms | speed-up | max abs difference |")
    print("|---|---:|---:|---:|---:|")
    for probe in (probe_qkv, probe_gate_up, probe_norm, probe_gelu, probe_attention, probe_head_loss):
        what, before, after = probe()
        times = [best_ms(lambda fn=fn: fn().sum().backward()) for fn in (before, after)]
        with torch.no_grad():
            diff = (before().double() - after().double()).abs().max().item()
        print(f"| {what} | {times[0]:.1f} | {times[1]:.1f} | {times[0] / times[1]:.2f}x | {diff:.2g} |")


if __name__ == "__main__":
    main()
