"""Cross-entropy of the LM head without materialising the logits of the whole batch.

`linear_cross_entropy_sum(hidden, weight, labels)` equals
`F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=-100, reduction="sum")` up to float
rounding. It walks the tokens in chunks of about `CHUNK_LOGITS` logits: per chunk, the logits (computed in
the input dtype, then fp32 as HF does), the log-sum-exp, the loss, and at once the gradients of the hidden
states and of the head (softmax minus one-hot, times each side). The backward pass then only scales the
saved gradients by the incoming one: the fp32 logits, their log-softmax and its gradient, [tokens, vocab]
each, never exist for the whole batch (for mT5's 250k vocabulary they dwarf every activation).

Written by hand: PyTorch has no fused linear + cross-entropy op (Liger Kernel and Apple's Cut Cross-Entropy
are GPU-only Triton kernels); this one is plain matmuls and works on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over labels != -100, from logits (cast to fp32, as HF does). With vocab-parallel
    logits (a DTensor sharded on the vocabulary) call it under `loss_parallel()`: the softmax is then
    computed without gathering."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
# Logits per chunk (32 MiB in fp32): 261 tokens at a 32128-word vocabulary, where a 2-core CPU's matmul is
# fastest (48 ms per 456-token head instead of 58 ms for one [456, 32128] product); 33 tokens at mT5's.
CHUNK_LOGITS = 1 << 23


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,  # type: ignore[override]
                chunk_tokens: int) -> torch.Tensor:
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        # fp32 accumulation of the head's gradient over chunks, whatever the compute dtype.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[start:start + chunk_tokens], labels[start:start + chunk_tokens]
            logits = (h @ weight.t()).float()
            valid = y != IGNORE_INDEX
            target = y.clamp(min=0).unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, target).squeeze(1)) * valid).sum()
            if need_grad:
                # d(loss)/d(logits) = softmax - one_hot(label), zero for ignored tokens; in place over the logits.
                grad = logits.sub_(lse.unsqueeze(1)).exp_()
                grad.scatter_add_(1, target, torch.full_like(target, -1, dtype=grad.dtype))
                grad.mul_(valid.unsqueeze(1))
                grad = grad.to(hidden.dtype)
                grad_hidden[start:start + chunk_tokens] = grad @ weight
                if h.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad.t(), h)
                else:
                    grad_weight += grad.t() @ h
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_total.to(grad_hidden.dtype),
                (grad_weight * grad_total).to(ctx.weight_dtype), None, None)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_logits: int = CHUNK_LOGITS) -> torch.Tensor:
    """Summed fp32 cross-entropy of `hidden @ weight.T` against `labels` (-100: ignored).

    hidden [..., d_model], weight [vocab, d_model], labels [...]. Under autocast both operands are cast to the
    autocast dtype first (as F.linear would be), so the head's gradient flows back through the cast."""
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    chunk_tokens = max(1, chunk_logits // weight.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropySum.apply(hidden, weight, labels.reshape(-1), chunk_tokens)
