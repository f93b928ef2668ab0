"""What `t5forge report` reads of a run directory: the config, metrics.jsonl (a corrupt line skipped and
counted, as the metrics writer's own recovery does), run_info.json, comm_audit.json, the checkpoints with
their verification, the best fine-tuned model and its predictions. Only reads: a report never changes a run."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from t5forge.errors import ConfigError
from t5forge.train.build import RUN_INFO
from t5forge.train.checkpoint import checkpoint_problems
from t5forge.train.metrics import read_records
from t5forge.train.trackers import flatten

# What the page reads of run_info.json (Trainer.run_info).
INFO_KEYS = ("model", "variant", "parameters", "architecture", "model_state_gib", "layout", "precision", "device",
             "batch")
# What an evaluation by the trainer logs; a fine-tuning evaluation logs valid_<metric> besides.
VALIDATION_KEYS = ("valid_loss", "valid_perplexity", "valid_accuracy")
NOT_TASK_METRICS = {*VALIDATION_KEYS, "valid_generated"}


@dataclass
class Checkpoint:
    step: int
    path: Path
    bytes: int
    status: str  # "ok", or the problems checkpoint_problems found


@dataclass
class Run:
    path: Path
    name: str
    config: dict
    config_text: str
    records: list[dict]
    skipped_lines: int
    info: dict | None
    comm_audit: dict | None
    checkpoints: list[Checkpoint]
    best: dict | None  # RUN_DIR/best/best.json: metric, value, iteration
    predictions: list[dict] = field(default_factory=list)  # at the best iteration (else the last evaluation)
    predictions_iteration: int | None = None
    notices: list[str] = field(default_factory=list)

    @property
    def train(self) -> list[dict]:
        return [r for r in self.records if "loss" in r]

    @property
    def validation(self) -> list[dict]:
        return [r for r in self.records if "valid_loss" in r]

    @property
    def evaluations(self) -> list[dict]:
        """Fine-tuning's evaluations by generation (records with predictions)."""
        return [r for r in self.records if "predictions" in r]

    @property
    def task_metrics(self) -> list[str]:
        keys = []
        for record in self.evaluations:
            keys += [k for k, v in record.items() if k.startswith("valid_") and k not in NOT_TASK_METRICS
                     and isinstance(v, (int, float)) and k not in keys]
        return keys

    @property
    def model(self) -> str:
        if self.info is not None:
            return f"{self.info['model']} ({self.info['variant']}, vocabulary {self.info['architecture']['vocab_size']})"
        model = self.config.get("model", {})
        return str(model.get("preset") or model.get("path") or "?")

    @property
    def architecture(self) -> str:
        """What makes two runs' models the same (a fine-tuning of a run's export is of the same model)."""
        if self.info is None:
            return self.model
        a = self.info["architecture"]
        return (f"{self.info['variant']}, vocabulary {a['vocab_size']}, d_model {a['d_model']}, "
                f"{a['num_layers']}+{a['num_decoder_layers']} layers")

    def steady(self) -> list[dict]:
        """The training records after warm-up: the first log period (compilation, loader workers starting)
        and a first step that compiled do not predict the rest. All of them when there is no other."""
        records = [r for r in self.train if "first_step_s" not in r]
        return records[1:] if len(records) > 1 else records


def median_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return statistics.median(values) if values else None


def tokens_seen(record: dict) -> float | None:
    """Tokens (inputs + targets) consumed up to this record: its samples times the tokens per sample, which is
    the ratio of the record's token and sample rates."""
    samples, rate, token_rate = record.get("consumed_samples"), record.get("samples_per_s"), record.get("tokens_per_s")
    if not samples or not rate or token_rate is None:
        return None
    return samples * token_rate / rate


def _json_file(path: Path, notices: list[str], required: tuple[str, ...] = ()) -> dict | None:
    """A JSON object of the run (None with a notice when it is not one, or lacks a `required` key)."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        notices.append(f"{path.name} is not valid JSON ({e}); not shown")
        return None
    if not isinstance(value, dict) or any(key not in value for key in required):
        notices.append(f"{path.name} is not what t5forge writes there (a different version, or damaged); not shown")
        return None
    return value


def _checkpoints(run_dir: Path, verify: bool) -> list[Checkpoint]:
    found = []
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        try:
            step = int(path.name.removeprefix("step_"))
        except ValueError:
            continue
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        problems = checkpoint_problems(path, checksums=verify)
        status = "; ".join(problems) if problems else ("ok" if verify else "ok (sizes; checksums not read)")
        found.append(Checkpoint(step, path, size, status))
    return found


def load_run(path: str | Path, verify_checksums: bool = True) -> Run:
    """A run directory of `t5forge train` / `finetune`, or a ConfigError saying what it is not."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory; pass the run directory of `t5forge train` "
                          "(train.output_dir)")
    if not (run_dir / "config.yaml").is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"{run_dir} is not a t5forge run directory (no config.yaml, no metrics.jsonl); pass "
                          "the train.output_dir of a run")
    notices: list[str] = []
    config, config_text = {}, ""
    if (run_dir / "config.yaml").is_file():
        config_text = (run_dir / "config.yaml").read_text(encoding="utf-8", errors="replace")
        try:
            loaded = OmegaConf.to_container(OmegaConf.create(config_text))
            config = loaded if isinstance(loaded, dict) else {}
        except Exception as e:  # omegaconf's parse errors have no common base class but Exception
            notices.append(f"config.yaml could not be read ({type(e).__name__}); not shown")
    else:
        notices.append("no config.yaml")
    records, skipped = read_records(run_dir / "metrics.jsonl")
    if skipped:
        notices.append(f"{skipped} line(s) of metrics.jsonl are not records (torn or damaged) and were skipped")
    if not records:
        notices.append("no metrics yet: the run has not logged a step")
    run = Run(path=run_dir, name=run_dir.resolve().name, config=config, config_text=config_text,
              records=records, skipped_lines=skipped, info=_json_file(run_dir / RUN_INFO, notices, INFO_KEYS),
              comm_audit=_json_file(run_dir / "comm_audit.json", notices, ("rows", "totals", "layout")),
              checkpoints=_checkpoints(run_dir, verify_checksums),
              best=_json_file(run_dir / "best" / "best.json", notices), notices=notices)
    evaluations = run.evaluations
    if evaluations:
        at = run.best["iteration"] if run.best and "iteration" in run.best else evaluations[-1]["iteration"]
        chosen = next((r for r in evaluations if r["iteration"] == at), evaluations[-1])
        file = Path(str(chosen["predictions"]))
        file = file if file.is_file() else run_dir / "predictions" / file.name  # a run directory moved
        if file.is_file():
            run.predictions_iteration = chosen["iteration"]
            for line in file.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    prediction = json.loads(line)
                except ValueError:
                    continue
                if isinstance(prediction, dict):
                    run.predictions.append(prediction)
        else:
            notices.append(f"the predictions of iteration {chosen['iteration']} ({file.name}) are missing")
    return run


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).exists() for marker in ("config.yaml", "metrics.jsonl"))


def config_differences(runs: list[Run]) -> list[tuple[str, list]]:
    """The dotted config keys whose values differ between the runs (output paths included), with each run's."""
    flat = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flat))
    missing = object()
    rows = []
    for key in keys:
        values = [f.get(key, missing) for f in flat]
        if any(v != values[0] for v in values[1:]):
            rows.append((key, ["(absent)" if v is missing else v for v in values]))
    return rows


__all__ = ["Checkpoint", "Run", "config_differences", "flatten", "is_run_dir", "load_run",
           "median_of", "tokens_seen"]
