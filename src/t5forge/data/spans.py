"""T5's span-corruption objective, exactly as t5.data.preprocessors.span_corruption defines it.

A raw chunk of `tokens_length` tokens is split into alternating non-noise / noise spans (it starts with
non-noise and ends with noise). The inputs keep the non-noise tokens and replace each noise span by one
sentinel; the targets hold each sentinel followed by the tokens it replaced. Both end with eos. The
chunk length is chosen (`compute_input_and_target_lengths`) so that inputs and targets have exactly the
requested lengths: 568 raw tokens -> 512 inputs and 114 targets with density 0.15 and mean span 3.

Ported to numpy from T5's TensorFlow code (random_spans_noise_mask, _random_segmentation,
noise_span_to_unique_sentinel): no maintained PyTorch/numpy package implements it, and the HF example
(run_t5_mlm_flax.py) is a script, not a library."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from t5forge.errors import ConfigError


def _noise_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) in a chunk of `length` tokens, rounded as T5 rounds them."""
    num_noise_tokens = int(round(length * noise_density))
    return num_noise_tokens, int(round(num_noise_tokens / mean_noise_span_length))


def _lengths_for(tokens_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(inputs length, targets length) after corrupting `tokens_length` raw tokens (eos included)."""
    num_noise_tokens, num_noise_spans = _noise_counts(tokens_length, noise_density, mean_noise_span_length)
    num_nonnoise_tokens = tokens_length - num_noise_tokens
    return num_nonnoise_tokens + num_noise_spans + 1, num_noise_tokens + num_noise_spans + 1


def compute_input_and_target_lengths(
    inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """T5's `compute_input_and_target_lengths`: the raw chunk length whose corruption fills
    `inputs_length` exactly, and the targets length it gives. (512, 0.15, 3) -> (568, 114)."""
    if not 0.0 < noise_density < 1.0:
        raise ConfigError(f"noise_density must be in (0, 1), got {noise_density}")
    if mean_noise_span_length < 1:
        raise ConfigError(f"mean_noise_span_length must be >= 1, got {mean_noise_span_length}")
    tokens_length = inputs_length
    while _lengths_for(tokens_length + 1, noise_density, mean_noise_span_length)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = _lengths_for(tokens_length, noise_density, mean_noise_span_length)
    # T5's adjustment so that with density 0.5 the targets are not longer than the inputs.
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of `num_segments` non-empty segments that partition `num_items`, uniformly at random."""
    first_in_segment = np.zeros(num_items, dtype=bool)
    first_in_segment[1:] = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
    segment_id = np.cumsum(first_in_segment)
    return np.bincount(segment_id, minlength=num_segments)


def random_spans_noise_mask(
    length: int, noise_density: float, mean_noise_span_length: float, rng: np.random.Generator
) -> np.ndarray:
    """Boolean mask [length], True = noise; alternating spans, starting with non-noise."""
    num_noise_tokens, _ = _noise_counts(length, noise_density, mean_noise_span_length)
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = max(int(round(num_noise_tokens / mean_noise_span_length)), 1)
    num_nonnoise_tokens = length - num_noise_tokens
    noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans, rng)
    nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans, rng)
    interleaved = np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1).reshape(-1)
    span_starts = np.cumsum(interleaved)[:-1]
    span_start_indicator = np.zeros(length, dtype=np.int64)
    span_start_indicator[span_starts] = 1
    return np.cumsum(span_start_indicator) % 2 == 1


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray, sentinel_ids: np.ndarray) -> np.ndarray:
    """Replace each run of noise tokens by the next sentinel (sentinel_ids[0] for the first run), drop
    the rest of the run."""
    prev_noise = np.concatenate([[False], noise_mask[:-1]])
    first_noise = noise_mask & ~prev_noise
    subsequent_noise = noise_mask & prev_noise
    out = tokens.copy()
    span_index = np.cumsum(first_noise) - 1
    out[first_noise] = sentinel_ids[span_index[first_noise]]
    return out[~subsequent_noise]


@dataclass(frozen=True)
class SpanCorruption:
    """Turns a raw chunk of `tokens_length` tokens into (inputs, targets) of the exact lengths."""

    inputs_length: int = 512
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    eos_id: int = 1
    sentinel_ids: tuple[int, ...] = ()
    tokens_length: int = field(init=False)  # raw tokens per example
    targets_length: int = field(init=False)

    def __post_init__(self) -> None:
        tokens_length, targets_length = compute_input_and_target_lengths(
            self.inputs_length, self.noise_density, self.mean_noise_span_length)
        object.__setattr__(self, "tokens_length", tokens_length)  # frozen dataclass: derived fields
        object.__setattr__(self, "targets_length", targets_length)
        num_spans = max(_noise_counts(tokens_length, self.noise_density, self.mean_noise_span_length)[1], 1)
        if len(self.sentinel_ids) < num_spans:
            raise ConfigError(
                f"span corruption of {tokens_length} tokens makes {num_spans} noise spans, but the tokenizer has "
                f"{len(self.sentinel_ids)} sentinels; use a shorter inputs_length or a higher mean span length")

    def __call__(self, tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """tokens [tokens_length] -> inputs [inputs_length], targets [targets_length] (int64)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        noise_mask = random_spans_noise_mask(len(tokens), self.noise_density, self.mean_noise_span_length, rng)
        sentinels = np.asarray(self.sentinel_ids, dtype=np.int64)
        inputs = noise_span_to_unique_sentinel(tokens, noise_mask, sentinels)
        targets = noise_span_to_unique_sentinel(tokens, ~noise_mask, sentinels)
        return np.append(inputs, self.eos_id), np.append(targets, self.eos_id)
