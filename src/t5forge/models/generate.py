"""Generation for the T5 family: greedy search, beam search and sampling, with a key/value cache.

`generate(model, input_ids, attention_mask=None, ...)` returns token ids [batch x num_return_sequences,
length] that begin with decoder_start_token_id, as transformers' `generate` returns them. The encoder runs
once; each step runs the decoder on the new position only, with the self-attention keys/values of the
earlier positions and the cross-attention keys/values of the encoder output in a `KVCache` (the cache is
an argument of the attention, models/t5.py; the search loops live here).

The searches follow transformers' own (generation/utils.py and logits_process.py, version 5) step by step,
so that the same model and settings give the same tokens: the logits processors in transformers' order
(repetition penalty, no-repeat n-grams, minimum new tokens, then temperature, top-k, top-p when sampling),
and the vectorised beam search with its length penalty, early-stopping heuristic and beam bookkeeping.
Written by hand because the model is not a transformers model; the HF `generate` cannot drive it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from t5forge.errors import ConfigError
from t5forge.models.static_cache import StaticDecoder
from t5forge.models.t5 import KVCache, T5ForConditionalGeneration

NEG_INF = -1.0e9  # transformers' "finished or impossible" score in beam search


@dataclass
class GenerationSettings:
    """The settings of one generate call; names and defaults are transformers' GenerationConfig's."""

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    num_beams: int = 1
    num_return_sequences: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                              f"got {self.min_new_tokens}")
        if self.num_beams < 1:
            raise ConfigError(f"num_beams must be >= 1, got {self.num_beams}")
        if self.num_return_sequences > self.num_beams and not (self.do_sample and self.num_beams == 1):
            raise ConfigError(f"num_return_sequences ({self.num_return_sequences}) must not exceed num_beams "
                              f"({self.num_beams}): beam search returns its best beams")
        if self.do_sample and self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.early_stopping not in (True, False, "never"):
            raise ConfigError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")


# -- logits processors (transformers' order and arithmetic) ---------------------------------------------------
def _banned_ngram_tokens(sequences: torch.Tensor, n: int) -> list[list[int]]:
    """Per row: the tokens that would repeat an n-gram already in the row (NoRepeatNGramLogitsProcessor)."""
    banned = []
    length = sequences.shape[1]
    for row in sequences.tolist():
        if length + 1 < n:
            banned.append([])
            continue
        prefix = tuple(row[length - n + 1:])
        banned.append([row[i + n - 1] for i in range(length - n + 1) if tuple(row[i:i + n - 1]) == prefix])
    return banned


def process_scores(scores: torch.Tensor, sequences: torch.Tensor, s: GenerationSettings, eos_token_id: int,
                   min_tokens_to_keep: int = 1, owned: bool = False) -> torch.Tensor:
    """scores [rows, vocab] of the next token given `sequences` [rows, length] (decoder tokens so far).
    owned: the caller's scores may be changed in place (a fresh tensor: no copy of rows x 250k scores)."""
    if s.repetition_penalty != 1.0:
        seen = torch.gather(scores, 1, sequences)
        seen = torch.where(seen < 0, seen * s.repetition_penalty, seen / s.repetition_penalty)
        scores = scores.scatter(1, sequences, seen)
    if s.no_repeat_ngram_size > 0:
        scores = scores if owned else scores.clone()
        for row, tokens in enumerate(_banned_ngram_tokens(sequences, s.no_repeat_ngram_size)):
            scores[row, tokens] = -float("inf")
    if s.min_new_tokens > 0 and sequences.shape[1] - 1 < s.min_new_tokens:  # 1: the decoder start token
        scores = scores if owned else scores.clone()
        scores[:, eos_token_id] = -float("inf")
    if not s.do_sample:
        return scores
    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k:
        k = min(max(s.top_k, min_tokens_to_keep), scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], -float("inf"))
    if s.top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - s.top_p)
        remove[..., -min_tokens_to_keep:] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))
    return scores


def row_topk(scores: torch.Tensor, k: int, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(scores, k) over the last dimension of [rows, n] scores (values descending, and their
    indices), through blocks: the k largest values lie in the k blocks of `block` columns with the largest
    maxima, so one pass of amax, a top-k over the block maxima and one over k x block candidates replace a
    top-k over all n columns (3-5x faster on CPU for mT5's 250,112 columns). Hand-written: torch.topk has no
    such path. Ties between equal values may pick other indices than torch.topk; T5 beams never tie."""
    rows, n = scores.shape
    blocks = n // block
    if blocks <= 4 * k:  # too few blocks to save anything
        return torch.topk(scores, k)
    whole = scores[:, :blocks * block].view(rows, blocks, block)
    top_blocks = torch.topk(whole.amax(dim=-1), k)[1]  # [rows, k]
    candidates = torch.gather(whole, 1, top_blocks[:, :, None].expand(rows, k, block)).view(rows, k * block)
    columns = (top_blocks[:, :, None] * block + torch.arange(block, device=scores.device)).view(rows, k * block)
    if blocks * block < n:  # the columns after the last whole block are candidates as they are
        candidates = torch.cat([candidates, scores[:, blocks * block:]], dim=1)
        tail = torch.arange(blocks * block, n, device=scores.device).expand(rows, -1)
        columns = torch.cat([columns, tail], dim=1)
    values, positions = torch.topk(candidates, k)
    return values, torch.gather(columns, 1, positions)


# -- the decoder, one step at a time ------------------------------------------------------------------------
class _Decoder:
    """The encoder output and the cache of a batch (rows: inputs x beams), stepped one token at a time."""

    def __init__(self, model: T5ForConditionalGeneration, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, rows_per_input: int):
        self.model = model
        encoded = model.encode(input_ids, attention_mask)
        if isinstance(encoded, DTensor):  # tensor parallel: replicated, every rank holds all of it
            encoded = encoded.to_local()
        self.encoded = encoded.repeat_interleave(rows_per_input, dim=0)
        self.mask = None if attention_mask is None else attention_mask.repeat_interleave(rows_per_input, dim=0)
        self.cache = KVCache(len(model.decoder.block))

    def next_logits(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the position after `last_tokens` [rows, 1]."""
        hidden = self.model.decoder_output(last_tokens, self.encoded, self.mask, cache=self.cache)
        logits = self.model.lm_head(hidden[:, -1:])
        if isinstance(logits, DTensor):  # tensor parallel: sharded on the vocabulary
            logits = logits.full_tensor()
        return logits[:, -1, :].float()


def _stop(done: bool, group) -> bool:
    """Whether to stop decoding: this batch is done, and with a `group`, every rank's batch is (ranks whose
    forward passes communicate, as under FSDP, must run the same number of decoder steps)."""
    if group is None:
        return done
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    flag = torch.tensor([0 if done else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return not bool(flag.item())


def generate(model: T5ForConditionalGeneration, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, stop_group=None, static_cache: bool = False,
             compile: bool = False, **settings) -> torch.Tensor:
    """Token ids [batch x num_return_sequences, length], each row beginning with decoder_start_token_id and
    padded with pad_token_id after its end. `settings`: see GenerationSettings. Sampling draws from
    `generator` (default: torch's global generator, as transformers does). With a `stop_group` (a process
    group), decoding goes on until every rank of it is done: for models whose forward pass communicates
    over ranks with different inputs (FSDP); a finished batch then only gains padding at its end.
    `static_cache`: decode with fixed-size buffers (models/static_cache.py), the same tokens; `compile`
    (implies it): the decode step through torch.compile, captured once per bucket of shapes (rows, output and
    input lengths rounded up to powers of two)."""
    s = GenerationSettings(**settings)
    s.validate()
    if input_ids.numel() == 0 or input_ids.shape[1] == 0:
        raise ConfigError("generate got an empty input: give at least one token per row")
    was_training = model.training
    model.eval()
    # inference_mode also skips autograd's version counting (8% of a greedy run in benchmarks/generate.md); a
    # sharded model (DTensor parameters: tensor parallel, FSDP) keeps no_grad, since FSDP gathers parameters
    # into buffers inside the forward pass that training uses afterwards.
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    try:
        with torch.no_grad() if sharded else torch.inference_mode():
            rows_per_input = s.num_beams if s.num_beams > 1 else s.num_return_sequences
            if static_cache or compile:
                decoder = StaticDecoder(model, input_ids, attention_mask, rows_per_input, 1 + s.max_new_tokens,
                                        compile)
            else:
                decoder = _Decoder(model, input_ids, attention_mask, rows_per_input)
            if s.num_beams > 1:
                return _beam_search(model, decoder, input_ids, s, generator, stop_group)
            return _greedy_or_sample(model, decoder, input_ids, s, generator, stop_group)
    finally:
        model.train(was_training)


def _greedy_or_sample(model, decoder, input_ids, s: GenerationSettings, generator, stop_group=None) -> torch.Tensor:
    cfg = model.config
    rows = input_ids.shape[0] * s.num_return_sequences
    sequences = torch.full((rows, 1), cfg.decoder_start_token_id, dtype=torch.long, device=input_ids.device)
    unfinished = torch.ones(rows, dtype=torch.bool, device=input_ids.device)
    for _ in range(s.max_new_tokens):
        scores = process_scores(decoder.next_logits(sequences[:, -1:]), sequences, s, cfg.eos_token_id)
        if s.do_sample:
            next_tokens = torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=generator).squeeze(1)
        else:
            next_tokens = scores.argmax(dim=-1)
        next_tokens = torch.where(unfinished, next_tokens, cfg.pad_token_id)
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
        unfinished &= next_tokens != cfg.eos_token_id
        if _stop(not unfinished.any(), stop_group):  # one host read per token, as in transformers
            break
    return sequences


def _beam_search(model, decoder, input_ids, s: GenerationSettings, generator, stop_group=None) -> torch.Tensor:
    """transformers' vectorised beam search (`_beam_search` and its helpers), for one eos token."""
    cfg = model.config
    batch, beams, device = input_ids.shape[0], s.num_beams, input_ids.device
    keep = 2 * beams  # candidates per input: max(2, 1 + number of eos tokens) x beams
    prompt_len, max_length = 1, 1 + s.max_new_tokens

    # transformers fills unused positions with `pad_token_id or eos_token_id`: eos for T5's pad id 0.
    fill = cfg.pad_token_id or cfg.eos_token_id
    running = torch.full((batch, beams, max_length), fill, dtype=torch.long, device=device)
    running[:, :, 0] = cfg.decoder_start_token_id
    finished_sequences = running.clone()
    running_scores = torch.zeros(batch, beams, device=device)
    running_scores[:, 1:] = NEG_INF
    finished_scores = torch.full((batch, beams), NEG_INF, device=device)
    finished_lengths = torch.zeros(batch, beams, dtype=torch.long, device=device)  # generated tokens
    is_finished = torch.zeros(batch, beams, dtype=torch.bool, device=device)
    improvable = torch.ones(batch, 1, dtype=torch.bool, device=device)
    top_beams = torch.arange(keep, device=device) < beams
    batch_offset = torch.arange(batch, device=device)[:, None] * beams
    # Which row each running beam came from at the last step (to reorder the cache).
    origin = torch.arange(batch * beams, device=device).view(batch, beams)

    def gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # along the beam dimension
        while index.dim() < tensor.dim():
            index = index.unsqueeze(-1)
        return torch.gather(tensor, 1, index.expand(*index.shape[:2], *tensor.shape[2:]))

    cur_len = prompt_len
    while cur_len < max_length:
        flat = running[:, :, :cur_len].reshape(batch * beams, cur_len)
        log_probs = F.log_softmax(decoder.next_logits(flat[:, -1:]), dim=-1)
        log_probs = process_scores(log_probs, flat, s, cfg.eos_token_id, min_tokens_to_keep=2, owned=True)
        vocab = log_probs.shape[-1]
        if s.do_sample:
            log_probs = (log_probs.view(batch, beams, vocab) + running_scores[:, :, None]).view(batch, beams * vocab)
            top_indices = torch.multinomial(log_probs.softmax(dim=-1), num_samples=keep, generator=generator)
            top_scores = torch.gather(log_probs, 1, top_indices)
            top_scores, order = top_scores.sort(dim=-1, descending=True)
            top_indices = top_indices.gather(1, order)
            top_beam, top_tokens = top_indices // vocab, top_indices % vocab
        else:
            # transformers takes the top `keep` of all beams x vocab scores plus the beams' running scores. The
            # same candidates, with the same sums: a beam's best `keep` tokens first (adding its running score
            # keeps their order), then the best `keep` of those beams x keep sums.
            beam_scores, beam_tokens = row_topk(log_probs, keep)
            sums = (beam_scores.view(batch, beams, keep) + running_scores[:, :, None]).view(batch, beams * keep)
            top_scores, positions = torch.topk(sums, k=keep)
            top_beam, top_tokens = positions // keep, torch.gather(beam_tokens.view(batch, beams * keep), 1, positions)
        top_sequences = gather(running, top_beam)
        top_sequences[:, :, cur_len] = top_tokens
        top_origin = top_beam + batch_offset
        hits_stop = (top_sequences[:, :, cur_len] == cfg.eos_token_id) | (cur_len + 1 >= max_length)

        # The beams that go on: the best candidates that did not just finish.
        candidates = top_scores + hits_stop.float() * NEG_INF
        go_on = torch.topk(candidates, k=beams)[1]
        running, running_scores = gather(top_sequences, go_on), gather(candidates, go_on)
        origin = gather(top_origin, go_on)

        # The finished hypotheses: merge those that just finished (among the top `beams`) into the best so far.
        just_finished = hits_stop & top_beams[None, :]
        scores = top_scores / ((cur_len + 1 - prompt_len) ** s.length_penalty)
        scores = scores + (is_finished.all(dim=-1, keepdim=True) & (s.early_stopping is True)).float() * NEG_INF
        scores = scores + (~improvable).float() * NEG_INF
        scores = scores + (~just_finished) * NEG_INF
        merged_scores = torch.cat([finished_scores, scores], dim=1)
        best = torch.topk(merged_scores, k=beams)[1]
        finished_sequences = gather(torch.cat([finished_sequences, top_sequences], dim=1), best)
        finished_scores = gather(merged_scores, best)
        finished_lengths = gather(torch.cat([finished_lengths, torch.full_like(top_beam, cur_len + 1 - prompt_len)],
                                            dim=1), best)
        is_finished = gather(torch.cat([is_finished, just_finished], dim=1), best)

        decoder.cache.reorder(origin.view(-1))
        cur_len += 1
        # Early-stopping heuristic: can a running beam still beat the worst finished one?
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_length = max_length - prompt_len
        else:
            best_length = cur_len - prompt_len
        best_running = running_scores[:, :1] / (best_length**s.length_penalty)
        worst_finished = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True)[0], NEG_INF)
        improvable = improvable & (best_running > worst_finished).any(dim=-1, keepdim=True)
        open_beams = not (bool(is_finished.all()) and s.early_stopping is True)
        if _stop(not (bool(improvable.any()) and open_beams and not bool(hits_stop.all())), stop_group):
            break

    out = finished_sequences[:, :s.num_return_sequences].reshape(batch * s.num_return_sequences, max_length)
    # As transformers: cut after the longest returned hypothesis.
    return out[:, :prompt_len + int(finished_lengths[:, :s.num_return_sequences].max())]
