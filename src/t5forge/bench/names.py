"""Benchmark names as LiBai and Megatron spell them, e.g. `t5_nl12_nah12_hs768_FP16_actrue_mp2_pp1_mb32_gb512_1n4g`.

Grammar: fields joined by `_`, the model family first and the devices last, the others in any order:

    FAMILY _ FIELD _ ... _ <nodes>n<devices>g

FAMILY: `t5` (T5 v1.0: ReLU FFN, tied head), `t5v11` (T5 v1.1 / Flan-T5: gated GELU, own head), `mt5`,
`umt5` (their gated FFN, own head, 250112-word vocabulary by default).

| field | meaning | required | default |
|---|---|---|---|
| `nl<N>` | encoder layers (and decoder layers unless `ndl`) | yes | |
| `nah<N>` | attention heads | yes | |
| `hs<N>` | hidden size (d_model) | yes | |
| `FP32` / `FP16` / `BF16` | precision (any case) | yes | |
| `mb<N>` | micro-batch size per data-parallel rank | yes | |
| `gb<N>` | global batch size | yes | |
| `ac<true/false/full/selective>` | activation checkpointing (`true` = full) | no | false |
| `mp<N>` | tensor (model) parallel size | no | 1 |
| `pp<N>` | pipeline parallel size | no | 1 |
| `ndl<N>` | decoder layers | no | nl |
| `ffn<N>` | d_ff | no | 4 x hs (t5), 2.5 x hs rounded to 64 (gated families) |
| `kv<N>` | per-head size d_kv | no | hs / nah |
| `vocab<N>` | vocabulary size | no | 32128 (t5, t5v11), 250112 (mt5, umt5) |
| `seq<N>` | input (encoder) tokens | no | 512 |
| `tgt<N>` | target (decoder) tokens | no | from span corruption of seq (114 for 512) |
| `zero<N>` | ZeRO stage 0-3 | no | 0 |
| `sp<true/false>` | sequence parallel | no | false |

Nodes x devices is the process count; data parallel = processes / (mp x pp). Without GPUs, devices
mean CPU processes. An unknown, repeated or malformed field is an error that names it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from t5forge.data.spans import compute_input_and_target_lengths
from t5forge.errors import ConfigError

FAMILIES = {  # family: (feed_forward_proj, tie_word_embeddings, model_type, default vocabulary)
    "t5": ("relu", True, "t5", 32128),
    "t5v11": ("gated-gelu", False, "t5", 32128),
    "mt5": ("gated-gelu", False, "mt5", 250112),
    "umt5": ("gated-gelu", False, "umt5", 250112),
}
_NUMBER_FIELDS = {"nl": "num_layers", "nah": "num_heads", "hs": "d_model", "mb": "micro_batch_size",
                  "gb": "global_batch_size", "mp": "tp", "pp": "pp", "ndl": "num_decoder_layers", "ffn": "d_ff",
                  "kv": "d_kv", "vocab": "vocab_size", "seq": "inputs_length", "tgt": "targets_length",
                  "zero": "zero_stage"}
_REQUIRED = ("nl", "nah", "hs", "precision", "mb", "gb", "devices")
_PRECISIONS = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
_AC = {"true": "full", "false": "none", "full": "full", "selective": "selective", "none": "none"}


@dataclass(frozen=True)
class BenchName:
    name: str
    family: str
    num_layers: int
    num_heads: int
    d_model: int
    precision: str
    micro_batch_size: int
    global_batch_size: int
    nodes: int
    devices: int
    activation_checkpointing: str = "none"
    tp: int = 1
    pp: int = 1
    num_decoder_layers: int | None = None
    d_ff: int | None = None
    d_kv: int | None = None
    vocab_size: int | None = None
    inputs_length: int = 512
    targets_length: int | None = None
    zero_stage: int = 0
    sequence_parallel: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def processes(self) -> int:
        return self.nodes * self.devices

    @property
    def dp(self) -> int:
        return self.processes // (self.tp * self.pp)

    def model_overrides(self) -> dict:
        """The architecture as T5Config fields."""
        ffn, tied, model_type, vocab = FAMILIES[self.family]
        gated = ffn.startswith("gated")
        d_ff = self.d_ff or (round(2.5 * self.d_model / 64) * 64 if gated else 4 * self.d_model)
        return {"num_layers": self.num_layers, "num_decoder_layers": self.num_decoder_layers or self.num_layers,
                "num_heads": self.num_heads, "d_model": self.d_model, "d_ff": d_ff,
                "d_kv": self.d_kv or self.d_model // self.num_heads, "vocab_size": self.vocab_size or vocab,
                "feed_forward_proj": ffn, "tie_word_embeddings": tied, "model_type": model_type}

    def target_tokens(self) -> int:
        if self.targets_length is not None:
            return self.targets_length
        return compute_input_and_target_lengths(self.inputs_length, 0.15, 3.0)[1]


def _error(name: str, token: str, why: str) -> ConfigError:
    return ConfigError(f"benchmark name {name!r}: field {token!r} {why}; see `t5forge bench --help` for the grammar "
                       "(e.g. t5_nl12_nah12_hs768_FP16_actrue_mp2_pp1_mb32_gb512_1n4g)")


def parse_bench_name(name: str) -> BenchName:
    """Parse a benchmark name (grammar in the module docstring); raise ConfigError naming the bad field."""
    tokens = name.split("_")
    if len(tokens) < 2 or tokens[0] not in FAMILIES:
        raise _error(name, tokens[0], f"is not a model family; expected one of {', '.join(FAMILIES)} first")
    values: dict = {"name": name, "family": tokens[0]}
    seen: set[str] = set()

    def put(key: str, value, token: str, short: str | None = None) -> None:
        if (short or key) in seen:
            raise _error(name, token, "repeats a field given earlier")
        seen.add(short or key)
        values[key] = value

    for token in tokens[1:]:
        lower = token.lower()
        if lower in _PRECISIONS:
            put("precision", _PRECISIONS[lower], token)
        elif match := re.fullmatch(r"(\d+)n(\d+)g", lower):
            put("devices", None, token)
            values["nodes"], values["devices"] = int(match[1]), int(match[2])
        elif match := re.fullmatch(r"ac(\w+)", lower):
            if match[1] not in _AC:
                raise _error(name, token, f"has activation checkpointing {match[1]!r}; use ac{'/ac'.join(_AC)}")
            put("activation_checkpointing", _AC[match[1]], token)
        elif match := re.fullmatch(r"sp(true|false)", lower):
            put("sequence_parallel", match[1] == "true", token)
        elif match := re.fullmatch(r"([a-z]+)(\d+)", lower):
            key = _NUMBER_FIELDS.get(match[1])
            if key is None:
                raise _error(name, token, f"is not a known field; known: {', '.join(_NUMBER_FIELDS)}, ac, sp, "
                                          "FP32/FP16/BF16, <nodes>n<devices>g")
            number = int(match[2])
            if number < (0 if key == "zero_stage" else 1):
                raise _error(name, token, "must be a positive number")
            put(key, number, token, short=match[1])
        else:
            raise _error(name, token, "is not FIELD<number>, ac<...>, sp<...>, a precision or <nodes>n<devices>g")
    missing = [key for key in _REQUIRED if key not in seen]
    if missing:
        spelled = {"precision": "FP32/FP16/BF16", "devices": "<nodes>n<devices>g"}
        raise ConfigError(f"benchmark name {name!r} lacks {', '.join(spelled.get(k, k + '<N>') for k in missing)}")
    bench = BenchName(**values)
    if bench.processes % (bench.tp * bench.pp):
        raise ConfigError(f"benchmark name {name!r}: {bench.nodes}n{bench.devices}g = {bench.processes} processes is "
                          f"not divisible by mp{bench.tp} x pp{bench.pp}")
    if bench.zero_stage > 3:
        raise _error(name, f"zero{bench.zero_stage}", "must be 0, 1, 2 or 3")
    per_step = bench.micro_batch_size * bench.dp
    if bench.global_batch_size % per_step:
        raise ConfigError(f"benchmark name {name!r}: gb{bench.global_batch_size} is not a multiple of mb"
                          f"{bench.micro_batch_size} x dp{bench.dp} = {per_step}")
    return bench


def run_overrides(bench: BenchName) -> list[str]:
    """The t5forge config overrides of the run a name describes (data and output come from the caller)."""
    model = [f"model.overrides.{k}={v}" for k, v in bench.model_overrides().items()]
    return [*model, "model.dropout_rate=0", f"precision.dtype={bench.precision}",
            f"data.inputs_length={bench.inputs_length}", f"train.micro_batch_size={bench.micro_batch_size}",
            f"train.global_batch_size={bench.global_batch_size}", f"parallel.dp={bench.dp}",
            f"parallel.tp={bench.tp}", f"parallel.pp={bench.pp}", f"parallel.zero_stage={bench.zero_stage}",
            f"parallel.sequence_parallel={str(bench.sequence_parallel).lower()}",
            f"parallel.activation_checkpointing={bench.activation_checkpointing}"]
