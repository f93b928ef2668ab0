"""Typed run configuration: dataclasses checked by OmegaConf, YAML files, dotted `key=value` overrides.

Batch-size arithmetic lives here and nowhere else (`batch_arithmetic`)."""

from __future__ import annotations

import difflib
import math
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from t5forge.errors import ConfigError


@dataclass
class ModelConfig:
    preset: str | None = None  # a preset name (t5forge info lists them) ...
    path: str | None = None  # ... or an HF model directory to start from
    dropout_rate: float | None = None  # None: the architecture's own
    overrides: dict[str, Any] = field(default_factory=dict)  # architecture fields, e.g. {num_layers: 4}


DATA_TASKS = ("span_corruption", "text_to_text")


@dataclass
class MixtureEntry:
    """One dataset of data.mixture: its prefix and either its weight or its language."""

    dataset: str | None = None  # indexed dataset prefix (PREFIX.bin / PREFIX.idx)
    weight: float | None = None  # relative sampling weight, >= 0 (the weights need not add up to 1)
    # a language code (e.g. de): languages are weighted by their training tokens ** data.mixture_temperature
    language: str | None = None


TASK_MIXING = ("examples_proportional", "weights")


@dataclass
class TaskEntry:
    """One task of data.tasks (text_to_text): its JSONL files and fields, prefix, sampling weight and metric."""

    name: str | None = None  # names the task in metrics.jsonl (valid_NAME/METRIC), predictions, best_metric
    train_file: str | None = None
    valid_file: str | None = None  # None: data.split of train_file's lines
    input_field: str = "input"
    target_field: str = "target"
    task_prefix: str = ""
    weight: float | None = None  # data.task_mixing=weights: relative sampling rate, >= 0
    metric: str = "exact_match"  # this task's score in the mean over tasks (valid_mean)


@dataclass
class DataConfig:
    task: str = "span_corruption"  # span_corruption (pretraining, `dataset`) | text_to_text (`t5forge finetune`)
    dataset: str | None = None  # span_corruption: indexed dataset prefix (PREFIX.bin / PREFIX.idx)
    tokenizer: str = MISSING  # tokenizer directory
    inputs_length: int = 512  # text_to_text: the longest input (eos included); longer ones are cut (`truncate`)
    # span_corruption: derived from the corruption arithmetic, checked if given; text_to_text: required, the
    # longest target (eos included)
    targets_length: int | None = None
    # text_to_text: JSONL files of {input_field: ..., target_field: ...} lines; a field holds text (tokenised
    # when the run starts) or a list of token ids (pre-tokenised). No valid_file: `split` of train_file's lines.
    train_file: str | None = None
    valid_file: str | None = None
    input_field: str = "input"
    target_field: str = "target"
    task_prefix: str = ""  # prepended to every input text, e.g. "summarize: "
    truncate: bool = True  # text_to_text: cut longer examples (counted in the log) or refuse them
    skip_empty: bool = True  # text_to_text: skip examples with an empty input or target (counted in the log) or refuse
    packing: bool = False  # text_to_text: several examples per row, attending only within themselves
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    split: list[float] = field(default_factory=lambda: [0.98, 0.01, 0.01])  # train, valid, test documents
    num_workers: int = 2
    # span_corruption: several indexed datasets instead of `dataset`, each split train/valid/test on its own and
    # sampled in fixed proportions (Megatron's blend): [{dataset: PREFIX, weight: w}, ...], or
    # [{dataset: PREFIX, language: xx}, ...] weighted by tokens ** mixture_temperature
    mixture: list[MixtureEntry] | None = None
    # language entries only: mT5's alpha, P(language) proportional to its training tokens ** alpha (mT5: 0.3;
    # 1: in proportion to tokens; 0: uniform)
    mixture_temperature: float | None = None
    # text_to_text: several tasks instead of train_file & co, [{name, train_file, valid_file?, input_field?,
    # target_field?, task_prefix?, weight?, metric?}, ...], mixed in fixed rates and evaluated one by one
    tasks: list[TaskEntry] | None = None
    # examples_proportional: rate of a task proportional to min(its training examples, task_mixing_cap) (T5's
    # examples-proportional mixing with its K); weights: proportional to each task's weight
    task_mixing: str = "examples_proportional"
    task_mixing_cap: int | None = None  # examples_proportional: None, no cap


TRACKERS = ("tensorboard", "wandb", "mlflow")  # train.trackers (train/trackers.py)


def check_stop_signals(names: list[str]) -> list[signal.Signals]:
    """train.stop_signals as signals (SIGTERM, TERM, ...), or a ConfigError naming the unknown or uncatchable one."""
    found = []
    for name in names:
        text = str(name).upper()
        number = getattr(signal.Signals, text if text.startswith("SIG") else f"SIG{text}", None)
        if number is None or number in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"train.stop_signals: {name!r} is not a signal a process can catch; use names such "
                              "as SIGTERM, SIGINT, SIGUSR1, SIGUSR2 (or [] for none)")
        found.append(number)
    return found


MIN_INPUTS_LENGTH = 8  # span corruption needs room for a noise span, its sentinel and eos


@dataclass
class TrainConfig:
    output_dir: str = MISSING
    # Train into a non-empty output_dir that holds no t5forge run (its files stay, the run's go beside them);
    # false: refuse it. An existing run directory is always accepted (train.resume decides what happens).
    overwrite_output_dir: bool = False
    micro_batch_size: int = 8
    global_batch_size: int | None = None  # None: micro_batch_size x dp (no accumulation)
    max_steps: int | None = None  # give max_steps or max_samples
    max_samples: int | None = None
    seed: int = 1234
    log_period: int = 10
    eval_period: int = 100  # 0: evaluate only at the end
    eval_samples: int = 256  # validation samples per evaluation (the same ones every time)
    save_period: int = 500  # 0: save only at the end
    keep_last: int = 3
    # Stop when this many steps in a row have a non-finite loss or gradient norm (fp16: were skipped by the
    # loss scaler); 0: never stop.
    max_nonfinite_steps: int = 5
    resume: str = "auto"  # auto | never | a checkpoint directory
    export_hf: bool = True  # write RUN_DIR/hf at the end
    compile: bool = False  # torch.compile every block (first step logs the compile time)
    # Speed-ups that round differently from transformers (each measured in benchmarks/README.md):
    fused_loss: bool = True  # LM head + cross-entropy in token chunks: no [tokens, vocab] fp32 logits
    fused_gelu: bool = True  # PyTorch's fused tanh-GELU kernel instead of HF's op-by-op formula
    comm_audit: bool = False  # audit the collectives of one step (the 2nd): table in the log, comm_audit.json
    # Signals that stop the run at the next step boundary with a checkpoint, exit status 128 + the signal's
    # number (train/preemption.py); []: every signal keeps its default action.
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    # Where the logged values go besides metrics.jsonl: tensorboard | wandb | mlflow (train/trackers.py;
    # wandb and mlflow are extras), under the project (W&B project, MLflow experiment) tracker_project.
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    tracker_project: str = "t5forge"


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | adafactor
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0  # never applied to norm weights (nor to biases, which T5 does not have)
    clip_grad_norm: float = 1.0  # 0: no clipping
    schedule: str = "constant"  # constant | linear | cosine | inverse_sqrt (each after linear warmup)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # floor of linear/cosine decay, as a fraction of lr


TASK_METRICS = ("exact_match", "token_f1", "rouge_l", "bleu")


@dataclass
class FinetuneConfig:
    """Evaluation by generation (text_to_text): every train.eval_period steps and at the end, the first
    train.eval_samples validation examples are generated and scored; the best model is kept in RUN_DIR/best."""

    # decides RUN_DIR/best: exact_match | token_f1 | rouge_l | bleu; with data.tasks also mean (each task's metric,
    # averaged), a task name (its metric), NAME/METRIC, or a metric (averaged over the tasks). None: exact_match,
    # or mean with data.tasks
    best_metric: str | None = None
    num_beams: int = 1
    max_new_tokens: int | None = None  # None: data.targets_length
    eval_batch_size: int = 32


@dataclass
class PrecisionConfig:
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (fp16 uses dynamic loss scaling)
    initial_loss_scale: float = 65536.0
    loss_scale_growth_interval: int = 2000


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
BACKENDS = ("auto", "nccl", "gloo")
# How global ranks fill the (pp, dp, tp) mesh, innermost dimension first (Megatron-core's `order`): consecutive
# ranks share a node, so the innermost dimension's groups stay inside nodes. The default keeps tensor
# parallelism there; the others exist to measure what a worse placement costs (tp across nodes).
RANK_ORDERS = ("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp")


@dataclass
class ParallelConfig:
    """`backend`, the process group's communication library:

    - auto: "cpu:gloo,cuda:nccl" on GPUs (CUDA tensors through NCCL, the rare host tensor through gloo),
      gloo on CPUs.
    - nccl: the same as auto on GPUs; refused without a GPU.
    - gloo: gloo for every tensor, also on GPUs, so that several processes can share one GPU (NCCL refuses
      two ranks on one device; processes beyond the GPU count wrap around). For tests, not speed: torch's
      ProcessGroupGloo copies CUDA tensors through pinned host memory for broadcast, all_reduce, all_gather
      (equal sizes only), gather, scatter and all_to_all, and runs reduce_scatter_tensor as an all_reduce of
      the whole input; send/recv and the coalesced all-gather take host tensors only, and it has no AVG
      reduction: on GPUs, pipeline parallelism and ZeRO 1-3 are refused with it (dp and tp work).

    `timeout_minutes` bounds every collective of the default group (a hang ends with an error after it);
    `rank0_work_timeout_minutes` bounds instead how long the other ranks wait while rank 0 alone works (HF
    export, checkpoint checksums, generation in fine-tuning evaluation), on a gloo group of its own."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"  # none | full | selective
    overlap_grad_reduce: bool = True  # ZeRO 0/1: reduce gradient buckets during the backward pass
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b (micro-batches: the accumulation steps)
    pp_layers: list[int] | None = None  # blocks per pipeline stage, encoder then decoder; None: balanced by FLOPs
    pp_stages_per_rank: int = 2  # interleaved_1f1b: virtual stages per pipeline rank
    backend: str = "auto"  # auto | nccl | gloo (see above)
    rank_order: str = "tp-dp-pp"  # innermost first: which groups hold consecutive ranks (RANK_ORDERS)
    timeout_minutes: float = 10.0  # of every collective of the default process group
    rank0_work_timeout_minutes: float = 60.0  # of the other ranks' wait while rank 0 alone works


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)


_CHOICES = {
    "optim.name": ("adamw", "adafactor"),
    "optim.schedule": ("constant", "linear", "cosine", "inverse_sqrt"),
    "precision.dtype": ("fp32", "bf16", "fp16"),
    "parallel.activation_checkpointing": ("none", "full", "selective"),
    "parallel.pp_schedule": PP_SCHEDULES,
    "parallel.backend": BACKENDS,
    "parallel.rank_order": RANK_ORDERS,
    "data.task": DATA_TASKS,
}


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items() if isinstance(node, dict) else []:
        name = f"{prefix}{k}"
        keys.append(name)
        if isinstance(v, dict) and k != "overrides":
            keys += _all_keys(v, name + ".")
    return keys


def _valid_keys() -> list[str]:
    return _all_keys(OmegaConf.to_container(OmegaConf.structured(RunConfig)))


def _explain(e: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    if isinstance(e, ConfigKeyError):
        close = difflib.get_close_matches(key, _valid_keys(), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else f"; valid keys: {', '.join(_valid_keys())}"
        return ConfigError(f"{source}: unknown config key {key!r}{hint}")
    if isinstance(e, ValidationError):
        first_line = str(e).splitlines()[0]
        return ConfigError(f"{source}: wrong type for {key!r}: {first_line}")
    if isinstance(e, MissingMandatoryValue):
        return ConfigError(f"{source}: {key} must be set (in the YAML file or as {key}=...)")
    return ConfigError(f"{source}: {str(e).splitlines()[0]}")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> RunConfig:
    """Schema defaults, then the YAML file, then `key=value` overrides; validated and checked."""
    config = OmegaConf.structured(RunConfig)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            config = OmegaConf.merge(config, OmegaConf.load(path))
        except OmegaConfBaseException as e:
            raise _explain(e, str(path)) from None
        except Exception as e:  # yaml's parser errors
            raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (for example train.max_steps=100)")
        key = item.split("=", 1)[0]
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", key):  # OmegaConf fails oddly on other keys
            raise ConfigError(f"override {item!r}: {key!r} is not a dotted key (for example train.max_steps=100)")
        try:
            config = OmegaConf.merge(config, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise _explain(e, f"override {item!r}") from None
        except yaml.YAMLError as e:  # the value is parsed as YAML
            raise ConfigError(f"override {item!r}: its value is not valid YAML ({str(e).splitlines()[0]}); "
                              "quote it") from None
    try:
        run: RunConfig = OmegaConf.to_object(config)
    except OmegaConfBaseException as e:
        raise _explain(e, str(path or "config")) from None
    check_config(run)
    return run


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def config_as_dict(run: RunConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(run))


def batch_arithmetic(global_batch_size: int | None, micro_batch_size: int, dp: int) -> tuple[int, int]:
    """The one place where global = micro x dp x accumulation is resolved.
    Returns (global_batch_size, gradient_accumulation_steps)."""
    if micro_batch_size < 1 or dp < 1:
        raise ConfigError(f"train.micro_batch_size ({micro_batch_size}) and parallel.dp ({dp}) must be >= 1")
    per_step = micro_batch_size * dp
    if global_batch_size is None:
        return per_step, 1
    if global_batch_size < 1 or global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({global_batch_size}) must be a multiple of train.micro_batch_size x "
            f"parallel.dp = {micro_batch_size} x {dp} = {per_step}; for example global_batch_size="
            f"{max(per_step, global_batch_size // per_step * per_step)}")
    return global_batch_size, global_batch_size // per_step


def check_mixture(entries: list[MixtureEntry], temperature: float | None) -> None:
    """data.mixture: every entry a dataset with either a weight or a language (all entries alike), weights >= 0
    and not all zero, and data.mixture_temperature set exactly when the entries give languages."""
    if not entries:
        raise ConfigError("data.mixture is empty; list at least one {dataset: PREFIX, weight: w}")
    for i, entry in enumerate(entries):
        if not entry.dataset:
            raise ConfigError(f"data.mixture[{i}] has no dataset; give each entry `dataset: PREFIX`")
        if (entry.weight is None) == (entry.language is None):
            raise ConfigError(f"data.mixture[{i}] ({entry.dataset}) needs exactly one of `weight` (a number >= 0) "
                              "and `language` (a code, weighted by tokens ** data.mixture_temperature)")
        if entry.weight is not None and not (entry.weight >= 0 and math.isfinite(entry.weight)):
            raise ConfigError(f"data.mixture[{i}] ({entry.dataset}) has weight {entry.weight}; weights must be "
                              "finite numbers >= 0")
    by_language = [entry.language is not None for entry in entries]
    if any(by_language) and not all(by_language):
        raise ConfigError("data.mixture mixes entries with a weight and entries with a language; give every entry a "
                          "weight, or every entry a language")
    if all(by_language):
        if temperature is None or not (temperature >= 0 and math.isfinite(temperature)):
            raise ConfigError(f"data.mixture gives languages, weighted by tokens ** data.mixture_temperature, which "
                              f"is {temperature}: set it to a number >= 0 (mT5 used 0.3; 1 samples in proportion "
                              "to tokens)")
    else:
        if temperature is not None:
            raise ConfigError("data.mixture_temperature weights language entries, but data.mixture gives weights, "
                              "which are used as they are: remove data.mixture_temperature")
        if sum(entry.weight for entry in entries) <= 0:
            raise ConfigError("data.mixture weights are all zero; give at least one dataset a positive weight")


def check_tasks(d: DataConfig) -> None:
    """data.tasks (text_to_text): named tasks, each with its train_file and a known metric, the single-task keys
    left unset, and data.task_mixing's inputs (weights, cap) given exactly when it uses them."""
    if d.tasks is None:
        if d.task_mixing != "examples_proportional" or d.task_mixing_cap is not None:
            raise ConfigError("data.task_mixing and data.task_mixing_cap mix the tasks of data.tasks, which is not "
                              "set: give data.tasks or remove them")
        return
    if not d.tasks:
        raise ConfigError("data.tasks is empty; list at least one {name: NAME, train_file: FILE}")
    single = {"train_file": None, "valid_file": None, "input_field": "input", "target_field": "target",
              "task_prefix": ""}
    for key, default in single.items():
        if getattr(d, key) != default:
            raise ConfigError(f"data.{key} is for one task; with data.tasks give each task its own {key} "
                              f"(data.tasks[i].{key}) and remove data.{key}")
    if d.task_mixing not in TASK_MIXING:
        raise ConfigError(f"data.task_mixing={d.task_mixing!r} is not one of {', '.join(TASK_MIXING)}")
    names = set()
    for i, task in enumerate(d.tasks):
        where = f"data.tasks[{i}]" + (f" ({task.name})" if task.name else "")
        if not task.name or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", task.name):
            raise ConfigError(f"{where} needs a name of letters, digits, _ . - (it names the task's metrics)")
        if task.name in names or task.name in ("mean", *TASK_METRICS):
            raise ConfigError(f"{where}: the name {task.name!r} is " + ("taken by another task" if task.name in names
                              else "a metric's name") + "; give each task a name of its own")
        names.add(task.name)
        if not task.train_file:
            raise ConfigError(f"{where} needs train_file (a JSONL file of input/target lines)")
        if task.metric not in TASK_METRICS:
            raise ConfigError(f"{where}: metric={task.metric!r} is not one of {', '.join(TASK_METRICS)}")
        weighed = task.weight is not None and task.weight >= 0 and math.isfinite(task.weight)
        if d.task_mixing == "weights" and not weighed:
            raise ConfigError(f"{where}: data.task_mixing=weights needs a weight >= 0 for every task, got "
                              f"{task.weight}")
        if d.task_mixing == "examples_proportional" and task.weight is not None:
            raise ConfigError(f"{where} has a weight, which data.task_mixing=examples_proportional does not use: set "
                              "data.task_mixing=weights, or remove the weights")
    if d.task_mixing == "weights":
        if sum(task.weight for task in d.tasks) <= 0:
            raise ConfigError("data.tasks weights are all zero; give at least one task a positive weight")
        if d.task_mixing_cap is not None:
            raise ConfigError("data.task_mixing_cap caps examples-proportional mixing, but data.task_mixing=weights: "
                              "remove data.task_mixing_cap")
    elif d.task_mixing_cap is not None and d.task_mixing_cap < 1:
        raise ConfigError(f"data.task_mixing_cap must be >= 1 examples (T5 used 2**19 and smaller), got "
                          f"{d.task_mixing_cap}")


def check_best_metric(best_metric: str | None, tasks: list[TaskEntry] | None) -> None:
    """finetune.best_metric: a metric; with data.tasks also mean, a task's name or NAME/METRIC."""
    if best_metric is None:
        return
    if not tasks:
        if best_metric not in TASK_METRICS:
            raise ConfigError(f"finetune.best_metric={best_metric!r} is not one of {', '.join(TASK_METRICS)}")
        return
    names = [task.name for task in tasks]
    name, _, metric = best_metric.partition("/")
    if best_metric in ("mean", *TASK_METRICS, *names) or (name in names and metric in TASK_METRICS):
        return
    raise ConfigError(f"finetune.best_metric={best_metric!r} is none of mean (each task's metric, averaged), a "
                      f"task ({', '.join(names)}), TASK/METRIC, or a metric averaged over the tasks "
                      f"({', '.join(TASK_METRICS)})")


def check_config(run: RunConfig) -> None:
    """Consistency checks that need no files: one message per problem, naming the key to change."""
    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(run, section), name)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")
    m = run.model
    if (m.preset is None) == (m.path is None):
        raise ConfigError("set exactly one of model.preset (a preset name) and model.path (an HF model directory)")
    t = run.train
    if (t.max_steps is None) == (t.max_samples is None):
        raise ConfigError("set exactly one of train.max_steps and train.max_samples")
    for key in ("max_steps", "max_samples"):
        if getattr(t, key) is not None and getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
    if t.max_nonfinite_steps < 0:
        raise ConfigError(f"train.max_nonfinite_steps must be >= 0 (0: never stop), got {t.max_nonfinite_steps}")
    for key in ("log_period", "eval_samples", "keep_last", "micro_batch_size"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
    for key in ("eval_period", "save_period"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    check_stop_signals(t.stop_signals)
    unknown = [name for name in t.trackers if name not in TRACKERS]
    if unknown or len(set(t.trackers)) != len(t.trackers):
        raise ConfigError(f"train.trackers={list(t.trackers)}: each once, from {list(TRACKERS)}")
    batch_arithmetic(t.global_batch_size, t.micro_batch_size, run.parallel.dp)
    o = run.optim
    if o.lr <= 0 or o.warmup_steps < 0 or not 0 <= o.min_lr_ratio <= 1 or len(o.betas) != 2:
        raise ConfigError("optim: lr must be > 0, warmup_steps >= 0, min_lr_ratio in [0, 1], betas two numbers")
    p = run.parallel
    if not 0 <= p.zero_stage <= 3:
        raise ConfigError(f"parallel.zero_stage must be 0, 1, 2 or 3, got {p.zero_stage}")
    if p.zero_stage == 1 and o.name == "adafactor":  # a flat shard cuts the rows and columns it factors over
        raise ConfigError("optim.name=adafactor factors each matrix's second moments over its rows and columns, "
                          "which ZeRO-1's flat shards cut through: set parallel.zero_stage to 0, 2 or 3, or "
                          "optim.name=adamw")
    if min(p.dp, p.tp, p.pp) < 1:
        raise ConfigError(f"parallel.dp, tp and pp must be >= 1, got {p.dp}, {p.tp}, {p.pp}")
    for key in ("timeout_minutes", "rank0_work_timeout_minutes"):
        if not getattr(p, key) > 0:
            raise ConfigError(f"parallel.{key} must be a positive number of minutes, got {getattr(p, key)}")
    d = run.data
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0 (0: load in the training process), got {d.num_workers}")
    if len(d.split) != 3:
        raise ConfigError(f"data.split must be three numbers (train, valid, test), got {d.split}")
    if d.task == "span_corruption":
        if (d.dataset is None) == (d.mixture is None):
            raise ConfigError("set exactly one of data.dataset (an indexed dataset prefix from `t5forge preprocess`) "
                              "and data.mixture (a list of {dataset: PREFIX, weight: w} or {dataset: PREFIX, "
                              "language: xx})")
        if d.mixture is not None:
            check_mixture(d.mixture, d.mixture_temperature)
        if d.inputs_length < MIN_INPUTS_LENGTH:
            raise ConfigError(f"data.inputs_length={d.inputs_length} is too short for span corruption; use at least "
                              f"{MIN_INPUTS_LENGTH} (512 is usual for T5)")
        if d.packing:
            raise ConfigError("data.packing is for data.task=text_to_text; span corruption fills every row already")
        if d.tasks is not None:
            raise ConfigError("data.tasks is for data.task=text_to_text (`t5forge finetune`); remove it")
    else:
        check_tasks(d)
        if d.tasks is None and d.train_file is None:
            raise ConfigError("data.task=text_to_text needs data.train_file (a JSONL file of input/target lines)")
        if d.mixture is not None:
            raise ConfigError("data.mixture is for span-corruption pretraining; a text_to_text task reads "
                              "data.train_file: remove data.mixture")
        if d.packing and run.parallel.pp > 1:
            raise ConfigError("data.packing is not built for pipeline parallelism (its stages pass padding masks "
                              "only): set data.packing=false or parallel.pp=1")
        if d.targets_length is None or d.targets_length < 2 or d.inputs_length < 2:
            raise ConfigError(f"data.task=text_to_text needs data.targets_length (the longest target in tokens, "
                              f"eos included, >= 2) and data.inputs_length >= 2; got {d.targets_length} and "
                              f"{d.inputs_length}")
    f = run.finetune
    if f.num_beams < 1 or f.eval_batch_size < 1 or (f.max_new_tokens is not None and f.max_new_tokens < 1):
        raise ConfigError("finetune.num_beams, eval_batch_size and max_new_tokens must be >= 1")
    check_best_metric(f.best_metric, d.tasks if d.task == "text_to_text" else None)
