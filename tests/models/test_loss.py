"""The LM head fused with the cross-entropy (models/loss.py) against F.linear + F.cross_entropy, per element:
the summed loss and the gradients of the hidden states and of the head, across chunk boundaries, with
ignored labels, under bf16 autocast and without autograd; the head's gradient held once, not copied;
evaluation's loss and argmax accuracy from chunks and from vocabulary shards; the chunk size per device and
per shape."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from t5forge.models import loss as loss_module
from t5forge.models.loss import (
    CHUNK_LOGITS,
    MIN_CHUNK_TOKENS,
    chunk_logits_for,
    chunk_tokens_for,
    linear_cross_entropy_sum,
    loss_and_correct_of_shards,
    token_loss_and_correct,
    vocab_shard_statistics,
)


def reference(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def inputs(seed=0, vocab=300, d=24, shape=(3, 11)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, d, generator=g).requires_grad_()
    weight = (torch.randn(vocab, d, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[0, -4:] = -100
    labels[2, 0] = -100
    return hidden, weight, labels


def grads(loss, hidden, weight, scale=0.7):
    hidden.grad = weight.grad = None
    (loss * scale).backward()  # a scaled loss, as the trainer's multiplier: the saved gradients are scaled
    return hidden.grad.clone(), weight.grad.clone()


# 1 token per chunk, 7 (does not divide the 33 tokens), and all at once.
@pytest.mark.parametrize("chunk_tokens", [1, 7, 33, 1000])
def test_loss_and_gradients_match_cross_entropy_of_the_logits(chunk_tokens):
    hidden, weight, labels = inputs()
    expected = reference(hidden, weight, labels)
    expected_grads = grads(expected, hidden, weight)
    fused = linear_cross_entropy_sum(hidden, weight, labels, chunk_logits=chunk_tokens * weight.shape[0])
    fused_grads = grads(fused, hidden, weight)
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-5)
    for ours, ref in zip(fused_grads, expected_grads):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # Ignored labels contribute nothing: their hidden states get no gradient.
    assert fused_grads[0][0, -4:].abs().max() == 0 and fused_grads[0][2, 0].abs().max() == 0


def test_bf16_autocast_computes_like_autocast_linear():
    hidden, weight, labels = inputs(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(hidden, weight, labels)
        fused = linear_cross_entropy_sum(hidden, weight, labels, chunk_logits=5 * weight.shape[0])
    expected_grads, fused_grads = grads(expected, hidden, weight), grads(fused, hidden, weight)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, expected, rtol=2e-3, atol=1e-2)
    for ours, ref in zip(fused_grads, expected_grads):
        assert ours.dtype == torch.float32  # the master weights' dtype, through the cast
        torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-3)


def test_without_autograd_only_the_loss_is_computed():
    hidden, weight, labels = inputs(seed=2)
    with torch.no_grad():
        fused = linear_cross_entropy_sum(hidden, weight, labels)
        expected = reference(hidden, weight, labels)
    assert not fused.requires_grad
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-5)


def test_model_refuses_to_drop_the_logits_without_labels():
    from t5forge.models.t5 import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_heads=2))
    ids = torch.randint(2, 64, (2, 5))
    with pytest.raises(ValueError, match="return_logits=False returns only the loss: pass labels"):
        model(input_ids=ids, decoder_input_ids=ids, return_logits=False)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors of `numel` elements that ops create while active (each storage once, views
    included), now and at their peak after any op; tensors that existed before (`ignore`d) are not counted."""

    def __init__(self, numel: int, ignore: torch.Tensor):
        super().__init__()
        self.numel, self.ignore, self.refs, self.peak = numel, ignore.untyped_storage().data_ptr(), {}, 0

    def now(self) -> int:
        self.refs = {ptr: ref for ptr, ref in self.refs.items() if ref() is not None}
        return sum(ref().untyped_storage().nbytes() for ref in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and t.untyped_storage().data_ptr() != self.ignore:
                self.refs.setdefault(t.untyped_storage().data_ptr(), weakref.ref(t))
        self.peak = max(self.peak, self.now())
        return out


def head_sized_allocation_peak(run, weight: torch.Tensor) -> float:
    """Peak bytes newly allocated by `run()` (the CPU allocator's events, C++ ones included) in tensors of the
    head's size (fp32 or 16-bit) or of the 1/16 blocks the in-place scaling uses, in units of the fp32 head."""
    unit = weight.numel() * 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        run()
    events = sorted((e for e in profile.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        if abs(event.nbytes()) in (unit, unit // 2, unit // 16):
            live += event.nbytes()
            peak = max(peak, live)
    return peak / unit


# (autocast, tokens per chunk) -> head-sized bytes alive after the forward pass and newly allocated at the
# backward pass's peak, in units of the fp32 [vocab, d_model] gradient. Before, the backward pass allocated a
# scaled fp32 copy of the accumulator (one unit more in every case), and one chunk under bf16 kept 1 in flight.
@pytest.mark.parametrize("autocast,chunk_tokens,in_flight,backward_peak", [
    (False, 7, 1.0, 0.0), (False, 1000, 1.0, 0.0),  # the accumulator, scaled in place, becomes weight.grad
    (True, 7, 1.0, 1.5),  # its bf16 rounding (the autocast weight's dtype), then fp32 for the master weight
    (True, 1000, 0.5, 1.0),  # one chunk: its bf16 product is exact, scaled in fp32 1/16 at a time, then fp32
])
def test_the_head_gradient_exists_once_per_micro_batch_and_is_not_copied(autocast, chunk_tokens, in_flight,
                                                                         backward_peak):
    hidden, weight, labels = inputs(seed=3, vocab=512, d=16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected_grads = grads(reference(hidden, weight, labels), hidden, weight)
    hidden.grad = weight.grad = None
    with LiveBytes(weight.numel(), ignore=weight) as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy_sum(hidden, weight, labels, chunk_logits=chunk_tokens * weight.shape[0])
        assert live.now() / (weight.numel() * 4) == in_flight
    assert head_sized_allocation_peak(lambda: (loss * 0.7).backward(), weight) == backward_peak
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, expected_grads[1], rtol=2e-2 if autocast else 1e-5,
                               atol=2e-3 if autocast else 1e-6)
    with pytest.raises(RuntimeError, match="backward runs once"):
        loss = linear_cross_entropy_sum(hidden, weight, labels)
        loss.backward(retain_graph=True)
        loss.backward()


def full_logits_reference(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    valid = labels != -100
    return reference(hidden, weight, labels), ((logits.argmax(-1) == labels) & valid).sum()


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])
def test_evaluation_head_gives_the_loss_and_accuracy_of_the_full_logits(chunk_tokens, autocast):
    hidden, weight, labels = inputs(seed=4)
    weight.data[:, 0] += 5.0  # hidden[..., 0] > 0 predicts well: accuracy near one half, not near zero
    labels = torch.where(labels == -100, labels, F.linear(hidden, weight).argmax(-1) * (hidden[..., 0] > 0)
                         + labels * (hidden[..., 0] <= 0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, correct = token_loss_and_correct(hidden, weight, labels, chunk_logits=chunk_tokens * weight.shape[0])
        expected_loss, expected_correct = full_logits_reference(hidden, weight, labels)
    assert 5 < correct.item() < 30
    assert correct.item() == expected_correct.item()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-5)


def test_vocabulary_shards_give_what_the_whole_head_gives_ties_to_the_lowest_index():
    """As under tensor parallelism: each shard of the head's rows reduces its logits to four numbers per
    token; combined, they are the full head's loss and argmax (a tie across shards: the first row wins)."""
    hidden, weight, labels = inputs(seed=5, vocab=300)
    with torch.no_grad():
        weight[250] = weight[40] = hidden[0, 0] * 100  # token (0, 0) predicts rows 40 and 250, equally
        labels[0, 0] = 40
        expected_loss, expected_correct = full_logits_reference(hidden, weight, labels)
        for bounds in ((0, 150, 300), (0, 100, 200, 300), (0, 1, 299, 300)):
            stats = torch.stack([vocab_shard_statistics(hidden, weight[a:b], labels, vocab_start=a,
                                                        chunk_logits=5 * (b - a)) for a, b in zip(bounds, bounds[1:])])
            loss, correct = loss_and_correct_of_shards(stats, labels)
            assert correct.item() == expected_correct.item(), bounds
            torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-5)
        labels[0, 0] = 250  # the tie goes to 40: wrong
        assert loss_and_correct_of_shards(stats, labels)[1] == correct - 1


def test_chunks_are_sized_for_the_device(monkeypatch):
    assert chunk_logits_for(torch.device("cpu")) == CHUNK_LOGITS == 1 << 23  # tuned on a 2-core CPU

    class Properties:
        total_memory = 141 * 10**9  # an H200

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    # 1 GiB of fp32 logits per chunk: 1073 tokens of mT5 (250,112 words), 3 GiB with its transients.
    assert chunk_logits_for(torch.device("cuda", 0)) == 1 << 28
    Properties.total_memory = 16 * 2**30  # 1/16 of a 16 GiB GPU, 12 bytes per logit
    assert chunk_logits_for(torch.device("cuda", 0)) == 2**30 // 12
    Properties.total_memory = 2**30  # never below the CPU's chunk
    assert chunk_logits_for(torch.device("cuda", 0)) == CHUNK_LOGITS


def test_mt5_vocabulary_in_the_cpu_budget_s_chunks():
    """mT5's 250,112 words in the CPU's logits budget (33-token chunks: the training loss's default takes
    these 80 tokens in one, test_the_training_loss_makes_no_thin_products_over_the_head), so 80 tokens cross
    two chunk boundaries; the loss, every element of both gradients, and evaluation's loss and accuracy over
    three uneven vocabulary shards equal the full logits'."""
    hidden, weight, labels = inputs(seed=7, vocab=250112, d=8, shape=(4, 20))
    assert CHUNK_LOGITS // 250112 < hidden.shape[0] * hidden.shape[1] // 2
    expected = reference(hidden, weight, labels)
    expected_grads = grads(expected, hidden, weight)
    loss = linear_cross_entropy_sum(hidden, weight, labels, chunk_logits=CHUNK_LOGITS)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-4)
    # Each hidden-state gradient sums 250,112 products in fp32, so two summation orders part by ~1e-5
    # (torch's own path too): every element is held against fp64, no further from it than torch's fp32 is.
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact = grads(reference(h64, w64, labels), h64, w64)
    for got, want, truth in zip(grads(loss, hidden, weight), expected_grads, exact):
        torch_error = (want.double() - truth).abs().max().item()
        assert (got.double() - truth).abs().max().item() <= 2 * torch_error + 1e-7
    with torch.no_grad():
        expected_loss, expected_correct = full_logits_reference(hidden, weight, labels)
        bounds = (0, 83371, 166742, 250112)
        stats = torch.stack([vocab_shard_statistics(hidden, weight[a:b], labels, vocab_start=a)
                             for a, b in zip(bounds, bounds[1:])])
        loss, correct = loss_and_correct_of_shards(stats, labels)
    assert correct.item() == expected_correct.item()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-4)


def fewest_chunks(tokens, budget_tokens, min_tokens):
    """The chunk count by search: the fewest even chunks within the budget, unless that thins one below
    min_tokens tokens (then as many as min_tokens allows, at least one)."""
    chunks = next(k for k in range(1, tokens + 1) if -(-tokens // k) <= budget_tokens)
    while chunks > 1 and tokens // chunks < min_tokens:
        chunks -= 1
    return chunks


@pytest.mark.parametrize("vocab", [32128, 250112])
def test_chunks_are_the_fewest_within_the_budget_and_never_thinner_than_the_minimum(vocab, monkeypatch):
    class Properties:
        total_memory = 141 * 10**9  # an H200

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        budget = chunk_logits_for(device) // vocab
        for tokens in (1, 33, 228, 255, 256, 257, 456, 912, 1073, 1074, 4000, 7296, 65536):
            for min_tokens in (1, 256):
                size = chunk_tokens_for(tokens, vocab, device, min_tokens=min_tokens)
                chunks = -(-tokens // size)
                assert chunks == fewest_chunks(tokens, budget, min_tokens), (device, tokens, min_tokens)
                assert size == -(-tokens // chunks)  # even: the last chunk is the others' size up to rounding
                if tokens <= budget:  # all the logits fit: one chunk, no accumulator
                    assert chunks == 1
                if tokens >= min_tokens:
                    assert tokens // chunks >= min_tokens
                if chunks == fewest_chunks(tokens, budget, 1):  # the minimum did not widen the chunks
                    assert size <= budget


class HeadProducts(TorchDispatchMode):
    """The number of rows (tokens) of each matrix product with one side as tall as the head (vocab rows)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default):
            a, b = args[-2], args[-1]
            if self.vocab in (b.shape[1], a.shape[1]):  # logits: h @ weight.T; hidden states' gradient: grad @ weight
                self.rows.append(a.shape[0])
            elif a.shape[0] == self.vocab:  # the head's gradient: grad.T @ h
                self.rows.append(a.shape[1])
        return func(*args, **(kwargs or {}))


def test_the_training_loss_makes_no_thin_products_over_the_head(monkeypatch):
    """With a logits budget of 10 tokens (as mT5's 33 on a CPU), the default chunks of the training loss still
    hold MIN_CHUNK_TOKENS tokens or more: each of its three products per chunk (logits, hidden states' and
    head's gradients) multiplies that many rows; tokens fewer than that make one chunk. An explicit budget
    is kept (the exactness tests above use it) and the gradients stay exact."""
    vocab = 300
    monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 10 * vocab)
    for tokens in (MIN_CHUNK_TOKENS - 56, 2 * MIN_CHUNK_TOKENS + 88):
        hidden, weight, labels = inputs(seed=8, vocab=vocab, d=16, shape=(4, tokens // 4))
        expected_grads = grads(reference(hidden, weight, labels), hidden, weight)
        with HeadProducts(vocab) as products:
            loss = linear_cross_entropy_sum(hidden, weight, labels)
        chunks = 1 if tokens < MIN_CHUNK_TOKENS else tokens // MIN_CHUNK_TOKENS
        assert len(products.rows) == 3 * chunks and min(products.rows) >= min(tokens, MIN_CHUNK_TOKENS)
        for ours, ref in zip(grads(loss, hidden, weight), expected_grads):  # the head's sums 600 tokens' products
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    with HeadProducts(vocab) as products:
        linear_cross_entropy_sum(hidden, weight, labels, chunk_logits=10 * vocab)
    assert max(products.rows) == 10
