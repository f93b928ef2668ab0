"""HuggingFace checkpoints in and out: config.json + safetensors (single or sharded), pytorch_model.bin.

The one place that knows how HF spells T5 configs and weights:
- Parameter names are identical to ours, except that HF checkpoints may also carry copies of the
  embedding under `encoder.embed_tokens.weight` / `decoder.embed_tokens.weight`, and old ones an unused
  cross-attention relative bias. Anything else missing, unexpected or mis-shaped is an error.
- Head tying: a checkpoint without `lm_head.weight` has its head tied to `shared.weight`; exports
  write `lm_head.weight` exactly when the head is untied, so a directory converts back bit for bit.
- Output rescaling (d_model**-0.5, T5 v1.0): HF 5.x stores it as `scale_decoder_outputs`; HF 4.x (and
  every published checkpoint) derive it from `tie_word_embeddings`. We read both and write both:
  `tie_word_embeddings` says whether the head is tied (false for v1.1 / mT5 / UMT5, as 4.x needs).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from t5forge.errors import CheckpointError, ConfigError
from t5forge.fileio import staged_files
from t5forge.models.t5 import MODEL_TYPES, T5Config, T5ForConditionalGeneration

HF_ARCHITECTURES = {
    "t5": "T5ForConditionalGeneration",
    "mt5": "MT5ForConditionalGeneration",
    "umt5": "UMT5ForConditionalGeneration",
}
# HF's config defaults where a config.json leaves a field out (they differ by model_type).
_HF_DEFAULTS = {
    "t5": dict(vocab_size=32128, d_ff=2048, num_layers=6, num_heads=8, feed_forward_proj="relu"),
    "mt5": dict(vocab_size=250112, d_ff=1024, num_layers=8, num_heads=6, feed_forward_proj="gated-gelu"),
    "umt5": dict(vocab_size=250112, d_ff=1024, num_layers=8, num_heads=6, feed_forward_proj="gated-gelu"),
}
_FIELDS = [
    "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
    "relative_attention_num_buckets", "relative_attention_max_distance", "dropout_rate",
    "layer_norm_epsilon", "initializer_factor", "feed_forward_proj", "pad_token_id", "eos_token_id",
    "decoder_start_token_id",
]
# Keys derived from the fields above, or describing the file rather than the model: rewritten on export.
_DERIVED_KEYS = {"architectures", "model_type", "tie_word_embeddings", "scale_decoder_outputs", "dense_act_fn",
                 "is_gated_act", "is_encoder_decoder", "dtype", "torch_dtype", "transformers_version"}
# Present in some HF checkpoints, never used by the model.
_IGNORED_KEYS = {"decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"}
_EMBEDDING_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


# -- config ------------------------------------------------------------------------------------------------
def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory; pass an HF model directory (config.json + weights)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json; pass an HF model directory (config.json + weights)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON ({e}); restore it from the original model") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} does not hold a JSON object")
    return config


def config_from_hf(hf: dict[str, Any]) -> T5Config:
    """T5Config from the dict of an HF config.json. Raises ConfigError for non-T5 architectures."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        arch = ", ".join(hf.get("architectures") or []) or "no architectures listed"
        raise ConfigError(
            f"config.json describes model_type {model_type!r} ({arch}), not a T5-family model; t5forge reads "
            f"model_type {', '.join(MODEL_TYPES)} (T5, T5 v1.1, Flan-T5, mT5, UMT5)"
        )
    values = {"d_model": 512, "d_kv": 64, **_HF_DEFAULTS[model_type]}
    values.update({k: hf[k] for k in _FIELDS if hf.get(k) is not None})
    tie = hf.get("tie_word_embeddings", model_type != "mt5")
    if "scale_decoder_outputs" in hf:  # written by transformers 5.x
        scale = bool(hf["scale_decoder_outputs"])
    else:  # transformers 4.x: rescale iff tied; 5.x never rescales mT5, whose checkpoints are all untied
        scale = bool(tie) and model_type != "mt5"
    extra = {k: v for k, v in hf.items() if k not in _FIELDS and k not in _DERIVED_KEYS}
    return T5Config(**values, tie_word_embeddings=bool(tie), scale_decoder_outputs=scale,
                    model_type=model_type, extra=extra)


def config_to_hf(config: T5Config, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    hf = dict(config.extra)
    hf.update({k: getattr(config, k) for k in _FIELDS})
    hf.update(
        architectures=[HF_ARCHITECTURES[config.model_type]],
        model_type=config.model_type,
        dense_act_fn=config.dense_act_fn,
        is_gated_act=config.is_gated_act,
        is_encoder_decoder=True,
        tie_word_embeddings=config.tie_word_embeddings,
        scale_decoder_outputs=config.scale_decoder_outputs,
        dtype=str(dtype).removeprefix("torch."),
    )
    return dict(sorted(hf.items()))


# -- weights -----------------------------------------------------------------------------------------------
def _reason(error: BaseException) -> str:
    """What torch or safetensors says went wrong, in one line: their messages run over several lines (torch's
    weights-only refusal explains how to unpickle anyway; the reason is after "WeightsUnpickler error:")."""
    text = str(error).split("WeightsUnpickler error:")[-1]
    line = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    line = line.split(". ")[0].removesuffix(".")  # the first sentence: the rest is advice for torch users
    return line if len(line) <= 200 else line[:197] + "..."


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {file}: {_reason(e)}; the file is truncated or corrupt, copy it "
                              "again") from e


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    # weights_only: never unpickle arbitrary objects from a checkpoint. Memory-mapped, except the files
    # torch wrote before its zip format (torch < 1.6), which cannot be.
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "_use_new_zipfile_serialization=True" not in str(e):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # what the weights-only unpickler refuses
        if "Unsupported global" in str(e):
            raise CheckpointError(f"{file} holds Python objects; t5forge loads weights only: convert it to "
                                  "safetensors with a trusted tool") from e
        raise CheckpointError(f"cannot read {file}: not a PyTorch weights file ({_reason(e)}); the file is "
                              "corrupt or of another format") from e
    except Exception as e:  # torch raises many types (zip, runtime, OS) for a bad file
        raise CheckpointError(f"cannot read {file}: {_reason(e)}; the file is truncated or corrupt, copy it "
                              "again") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} does not hold a state dict of tensors; give a model's weights")
    return state


def _load_index(index_file: Path) -> list[Path]:
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_file} is not a valid shard index ({e})") from e
    shards = [index_file.parent / name for name in sorted(set(weight_map.values()))]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"{index_file} names shards that are missing: {', '.join(missing)}")
    return shards


def _weight_files(path: Path) -> tuple[bool, list[Path]]:
    """(safetensors?, the weight files) of an HF model directory, whichever of the four layouts it uses."""
    if (path / SAFE_WEIGHTS).is_file():
        return True, [path / SAFE_WEIGHTS]
    if (path / SAFE_INDEX).is_file():
        return True, _load_index(path / SAFE_INDEX)
    if (path / BIN_WEIGHTS).is_file():
        return False, [path / BIN_WEIGHTS]
    if (path / BIN_INDEX).is_file():
        return False, _load_index(path / BIN_INDEX)
    raise CheckpointError(
        f"{path} has no weights: expected {SAFE_WEIGHTS}, {SAFE_INDEX}, {BIN_WEIGHTS} or {BIN_INDEX}"
    )


def load_hf_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF model directory, whichever of the four layouts it uses."""
    safetensors, files = _weight_files(Path(path))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(_load_safetensors(file) if safetensors else _load_bin(file))
    return state


class HFTensorReader:
    """The tensors of an HF model directory, read lazily: names and shapes from the file headers, values
    one region at a time (safetensors `get_slice`; .bin files memory-mapped), so that a rank of a sharded
    model reads only what it holds. Names are ours (embedding aliases resolved, unused keys dropped)."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        path = Path(path)
        self.path = path
        self._where: dict[str, tuple[Any, str]] = {}  # our name -> (open file or bin state dict, stored name)
        safetensors, files = _weight_files(path)
        for file in files:
            if safetensors:
                try:
                    source = safe_open(file, framework="pt")
                except (SafetensorError, OSError, ValueError) as e:
                    raise CheckpointError(f"cannot read {file}: {_reason(e)}; the file is truncated or corrupt, "
                                          "copy it again") from e
            else:
                source = _load_bin(file)  # memory-mapped: tensors are read when sliced
            for key in source.keys():
                self._where[key] = (source, key)
        for alias in _EMBEDDING_ALIASES:
            stored = self._where.pop(alias, None)
            if stored is not None:
                self._where.setdefault("shared.weight", stored)
        for key in _IGNORED_KEYS:
            self._where.pop(key, None)

    def keys(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        source, key = self._where[name]
        if isinstance(source, dict):
            return tuple(source[key].shape)
        return tuple(source.get_slice(key).get_shape())

    def dtype_is_float(self, name: str) -> bool:
        source, key = self._where[name]
        if isinstance(source, dict):
            return source[key].is_floating_point()
        return source.get_slice(key).get_dtype() in ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `name`, or only `region` of it (one slice per dimension)."""
        source, key = self._where[name]
        if isinstance(source, dict):
            tensor = source[key]
            return (tensor[region] if region else tensor).clone()
        if region is None:
            return source.get_tensor(key)
        return source.get_slice(key)[region]

    def check_against(self, config: T5Config) -> bool:
        """Raise CheckpointError listing every missing, unexpected or mis-shaped tensor (as `build_model`);
        returns whether the head is tied (no `lm_head.weight` stored)."""
        tied = "lm_head.weight" not in self._where or (
            config.tie_word_embeddings and "shared.weight" in self._where
            and torch.equal(self.read("lm_head.weight"), self.read("shared.weight")))
        if tied:
            self._where.pop("lm_head.weight", None)
        with torch.device("meta"):
            model = T5ForConditionalGeneration(T5Config(**{**config.to_dict(), "tie_word_embeddings": tied}))
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        _check_names_and_shapes(expected, {k: self.shape(k) for k in self._where}, config, str(self.path))
        not_float = [k for k in self._where if not self.dtype_is_float(k)]
        if not_float:
            raise CheckpointError(f"{self.path} holds non-floating-point (quantized?) tensors: "
                                  f"{_summarise(sorted(not_float))}")
        return tied


def _check_names_and_shapes(expected: dict, found: dict, config: T5Config, source: str) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(f"{k} {tuple(found[k])} (expected {tuple(expected[k])})"
                       for k in set(expected) & set(found) if tuple(found[k]) != tuple(expected[k]))
    problems = []
    if missing:
        problems.append(f"missing: {_summarise(missing)}")
    if unexpected:
        problems.append(f"unexpected: {_summarise(unexpected)}")
    if misshaped:
        problems.append(f"wrong shape: {_summarise(misshaped)}")
    if problems:
        raise CheckpointError(
            f"{source} does not match its config ({config.model_type}, d_model={config.d_model}, "
            f"{config.num_layers}+{config.num_decoder_layers} layers): " + "; ".join(problems)
            + ". Use the config.json that was saved with these weights."
        )


def _summarise(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_dtype(key: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The requested dtype, except that in fp16 the FFN output projections stay fp32, as transformers
    keeps them (`_keep_in_fp32_modules`): T5 v1.1 activations overflow fp16 there."""
    if dtype is None:
        return tensor.dtype
    if dtype == torch.float16 and ".DenseReluDense.wo." in key:
        return torch.float32
    return dtype


def build_model(
    config: T5Config, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu", source: str = "checkpoint",
) -> T5ForConditionalGeneration:
    """A model holding exactly the tensors of `state` (HF names). The head is tied iff `state` has no
    `lm_head.weight`. Every missing, unexpected or mis-shaped tensor is reported in one error."""
    state = dict(state)
    for alias in _EMBEDDING_ALIASES:
        tensor = state.pop(alias, None)
        if tensor is not None:
            state.setdefault("shared.weight", tensor)
    for key in _IGNORED_KEYS:
        state.pop(key, None)
    tied = "lm_head.weight" not in state or (
        config.tie_word_embeddings and "shared.weight" in state
        and torch.equal(state["lm_head.weight"], state["shared.weight"])
    )
    if tied:
        state.pop("lm_head.weight", None)
    config = T5Config(**{**config.to_dict(), "tie_word_embeddings": tied}, extra=config.extra)

    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    expected = {k: v.shape for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    _check_names_and_shapes(expected, {k: v.shape for k, v in state.items()}, config, source)
    not_float = sorted(k for k, v in state.items() if not v.is_floating_point())
    if not_float:
        raise CheckpointError(f"{source} holds non-floating-point (quantized?) tensors: {_summarise(not_float)}")
    if tied:
        state["lm_head.weight"] = state["shared.weight"]
    state = {k: v.to(device=device, dtype=load_dtype(k, v, dtype)) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if tied:  # assign=True made two Parameters over one storage; make them one Parameter again
        model.lm_head.weight = model.shared.weight
    return model


def from_pretrained(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> T5ForConditionalGeneration:
    """Load an HF T5-family directory. dtype None keeps the stored dtypes (bit-exact weights)."""
    config = config_from_hf(read_hf_config(path))
    model = build_model(config, load_hf_state_dict(path), dtype=dtype, device=device, source=str(path))
    return model.eval()


def hf_state_dict(model: T5ForConditionalGeneration) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint of `model` holds: `lm_head.weight` only when the head is untied."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def parse_size(size: int | str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, scale in units.items():
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * scale)
            except ValueError:
                break
    if text.isdigit():
        return int(text)
    raise ConfigError(f"cannot read size {size!r}; write it like 5GB, 500MB or 2GiB")


def save_pretrained(
    model: T5ForConditionalGeneration, path: str | os.PathLike, max_shard_size: int | str = "5GB"
) -> None:
    """Write config.json + model.safetensors (or shards + index when larger than max_shard_size).

    Files appear atomically, config.json last; weight files of an earlier save in `path` are replaced."""
    path = Path(path)
    state = hf_state_dict(model)
    sizes = {k: v.numel() * v.element_size() for k, v in state.items()}
    before = {p.name for p in path.glob("*")} if path.is_dir() else set()
    written = save_pretrained_streamed(model.config, sizes, ((k, v.cpu()) for k, v in state.items()), path,
                                       dtype=model.shared.weight.dtype, max_shard_size=max_shard_size)
    # Weights of an earlier save that the new one does not overwrite would confuse loaders.
    for old in list(path.glob("model*.safetensors")) + list(path.glob("pytorch_model*.bin")) + [
        path / SAFE_INDEX, path / BIN_INDEX
    ]:
        if old.name in before and old.name not in written and old.is_file():
            old.unlink()


def save_pretrained_streamed(
    config: T5Config, sizes: dict[str, int], tensors, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
) -> set[str]:
    """Write an HF directory from `tensors`, an iterator of (name, tensor) in the order of `sizes`
    ({name: bytes}), holding at most one shard in memory: the shard plan comes from the sizes before any
    tensor arrives (for exports gathered one parameter at a time from a sharded model). A tied
    `lm_head.weight` is consumed but not written. Files appear atomically, config.json last; returns
    the names of the files written."""
    limit = parse_size(max_shard_size)
    written = [n for n in sizes if not (config.tie_word_embeddings and n == "lm_head.weight")]
    shards: list[list[str]] = [[]]
    used = 0
    for name in written:
        if shards[-1] and used + sizes[name] > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    files = ([SAFE_WEIGHTS] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    shard_of = {name: i for i, names in enumerate(shards) for name in names}
    path = Path(path)
    with staged_files(path) as staging:
        pending: dict[str, torch.Tensor] = {}
        current = 0
        for name, tensor in tensors:
            if name not in shard_of:
                continue
            pending[name] = tensor.contiguous()
            if len(pending) == len(shards[current]):
                save_file(pending, staging / files[current], metadata={"format": "pt"})
                pending, current = {}, current + 1
        if current != len(shards):
            raise CheckpointError(f"the export of {path} received only {current} of {len(shards)} shards")
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(sizes[n] for n in written)},
                     "weight_map": {n: files[shard_of[n]] for n in written}}
            (staging / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (staging / "config.json").write_text(json.dumps(config_to_hf(config, dtype=dtype), indent=2) + "\n")
        return {p.name for p in staging.iterdir()}
