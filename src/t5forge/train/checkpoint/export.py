"""The model as an HF directory (RUN_DIR/hf at the end of a run), and the best model of fine-tuning
(RUN_DIR/best, with best.json). Both are published by rename, like checkpoints: a reader or a crash never
finds half of one, and a crash between the two renames leaves the previous one aside for recovery."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from t5forge.errors import CheckpointError, ConfigError
from t5forge.lifecycle import is_main_process
from t5forge.models import hf as hf_io
from t5forge.parallel.parallelize import full_parameters, unwrap_name
from t5forge.parallel.pipeline import FullParameters
from t5forge.train.checkpoint.store import on_rank_zero, recover_published, staged

TOKENIZER_FILES = ("spiece.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BEST_JSON = "best.json"


def export_hf_model(model, config, target: str | os.PathLike, *, tokenizer_dir: str | os.PathLike | None = None, mesh=None,
                    extra_files: dict[str, str] | None = None) -> Path:
    """Gather the model one parameter at a time from any layout (collective; pipeline stages send theirs to
    rank 0) and write it on rank 0 as the HF directory `target` with the tokenizer files and `extra_files`
    ({name: text}), holding at most one shard in memory. Every rank returns `target` or raises rank 0's error."""
    target = Path(target)
    if mesh is not None and mesh.pp_size > 1:
        gathered = FullParameters(model, mesh)
        sizes, tensors = gathered.sizes, gathered.tensors()
    else:
        sizes = {unwrap_name(name): p.numel() * p.element_size() for name, p in model.named_parameters()}
        tensors = full_parameters(model, dst=0)  # the other ranks send their shards and keep nothing

    def write() -> None:
        try:
            with staged(target, sum(sizes.values())) as staging:
                # looked up when called: tests/reliability/faults.py wraps it
                hf_io.save_pretrained_streamed(config, sizes, tensors, staging, dtype=next(model.parameters()).dtype)
                for name in TOKENIZER_FILES:
                    source = Path(tokenizer_dir) / name if tokenizer_dir else None
                    if source is not None and source.is_file():
                        shutil.copyfile(source, staging / name)
                for name, text in (extra_files or {}).items():
                    (staging / name).write_text(text, encoding="utf-8")
        except Exception:
            for _ in tensors:  # the other ranks are still gathering
                pass
            raise

    if not is_main_process():
        for _ in tensors:  # take part in every gather
            pass
    on_rank_zero(write)
    return target


def read_best(best_dir: Path, metric: str) -> dict | None:
    """best.json of `best_dir` ({"metric", "value", "iteration", "scores"}), or None when there is none. A best
    model kept by another metric is refused: comparing this run's scores with its value would be meaningless,
    and ranking it by the new metric would keep it over better models of earlier evaluations."""
    recover_published(best_dir)
    file = best_dir / BEST_JSON
    if not file.is_file():
        return None
    try:
        best = json.loads(file.read_text(encoding="utf-8"))
        kept, _ = str(best["metric"]), float(best["value"])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file} is corrupt ({type(e).__name__}: {e}); move {best_dir} away to start a new "
                              "best model") from e
    if kept != metric:
        raise ConfigError(
            f"{best_dir} holds the best model by {kept} (its {BEST_JSON}), but finetune.best_metric={metric}: the "
            f"two cannot be compared. Resume with finetune.best_metric={kept}, or move {best_dir} away to keep "
            f"the best model by {metric} from now on")
    return best


class BestModel:
    """RUN_DIR/best: the HF model of the evaluation with the highest `metric` so far, with best.json ({"metric",
    "value", "iteration", "scores"}). Scores and decisions are rank 0's. A `resumed` run continues from
    best.json (read_best), read on rank 0 and handed to every rank, so a refusal stops them all (collective)."""

    def __init__(self, run_dir: str | os.PathLike, metric: str, resumed: bool):
        self.dir, self.metric = Path(run_dir) / "best", metric
        self.best = on_rank_zero(lambda: read_best(self.dir, metric)) if resumed else None

    def consider(self, scores: dict[str, float], iteration: int) -> bool:
        """Whether `scores` beat the best so far (a tie keeps the earlier); if so they become the best."""
        if self.best is not None and not scores[self.metric] > self.best["value"]:
            return False
        self.best = {"metric": self.metric, "value": scores[self.metric], "iteration": iteration, "scores": scores}
        return True

    def files(self) -> dict[str, str]:
        """best.json, to publish with the model (export_hf_model's extra_files; rank 0's counts)."""
        return {BEST_JSON: json.dumps(self.best, indent=1)}

    def publish_copy(self, export: Path) -> None:
        """Publish a copy of the HF directory `export` (the run's final export) with best.json: rank 0 copies,
        every rank returns or raises its error (collective)."""
        def copy() -> None:
            with staged(self.dir) as staging:
                shutil.copytree(export, staging, dirs_exist_ok=True)
                for name, text in self.files().items():
                    (staging / name).write_text(text, encoding="utf-8")
        on_rank_zero(copy)
