"""Experiment trackers (train.trackers): TensorBoard (the default), Weights & Biases and MLflow. Each gets the
run config, every record the metrics writer logs (training steps, validation, fine-tuning scores) and the
model summary (RUN_DIR/run_info.json). Only rank 0 logs.

A resumed run continues the same tracker run: its ids are kept in RUN_DIR/trackers.json. The steps a
resumed run repeats (those after its checkpoint, up to where the interrupted attempt had logged) are not
logged again: they give the same values (resume is bitwise), and W&B and MLflow would keep both points.
TensorBoard instead hides the old events from the resumed step on (purge_step).

W&B runs offline unless WANDB_MODE says otherwise or an API key is at hand (WANDB_API_KEY, or a login in
~/.netrc). Offline, each attempt of a resumed run is a directory RUN_DIR/wandb/offline-run-*-ID of its own
(the same run id): `wandb sync` them in order, the later ones with `--append`. MLflow logs to
MLFLOW_TRACKING_URI, by default a file store `mlruns` beside the run directory (shared by the runs there).
Neither sends usage telemetry (both would, by default)."""

from __future__ import annotations

import json
import math
import netrc
import os
import time
import uuid
from pathlib import Path

from t5forge.config import TRACKERS
from t5forge.errors import ConfigError
from t5forge.fileio import write_text_atomic

STATE_FILE = "trackers.json"
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow-skinny"}


def _numbers(record: dict, finite: bool = True) -> dict[str, float]:
    """A record's numbers (a path or a None is not a metric); `finite`: without NaN and infinities."""
    return {k: float(v) for k, v in record.items() if k != "iteration" and isinstance(v, (int, float))
            and not isinstance(v, bool) and (math.isfinite(v) or not finite)}


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """{"train.max_steps": 6, ...}: a nested config as dotted keys (its `key=value` override names)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict, info: dict | None, resumed_at: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides the events from that step on that the earlier attempt wrote.
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                    purge_step=None if resumed_at is None else resumed_at + 1)
        if not resumed_at:  # (markdown code blocks)
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)
            if info is not None:
                self.writer.add_text("model", "```\n" + json.dumps(info, indent=1) + "\n```", 0)

    def log(self, record: dict) -> None:
        for key, value in _numbers(record, finite=False).items():  # a diverging loss shows as NaN
            self.writer.add_scalar(key, value, record["iteration"])

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict, info: dict | None, run_id: str, project: str):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_key() else "offline")
        # The same settings to setup() as to init(): its telemetry reads setup's (init's alone still phones home).
        settings = wandb.Settings(mode=mode, silent=True, console="off", disable_git=True, disable_code=True,
                                  x_disable_stats=True, x_disable_machine_info=True, x_save_requirements=False)
        wandb.setup(settings=settings)
        # finish_previous: a run left open in this process (an error before its close) is not continued.
        self.run = wandb.init(dir=str(run_dir), project=project, name=run_dir.name, id=run_id, resume="allow",
                              config=config, settings=settings, reinit="finish_previous")
        if info is not None:
            self.run.summary.update({"model": info})

    def log(self, record: dict) -> None:
        self.run.log(_numbers(record), step=int(record["iteration"]))

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MlflowTracker:
    name = "mlflow"
    PARAMS_PER_CALL, METRICS_PER_CALL = 100, 1000  # MLflow's log_batch limits

    def __init__(self, run_dir: Path, config: dict, info: dict | None, run_id: str | None, project: str,
                 saved_uri: str | None = None):
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        # A resumed run goes on in the store its run is in (unless MLFLOW_TRACKING_URI now names another).
        self.uri = (os.environ.get("MLFLOW_TRACKING_URI") or saved_uri
                    or (run_dir.resolve().parent / "mlruns").as_uri())
        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(project))
            run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
            params = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                      for k, v in flatten(config).items()]
            for i in range(0, len(params), self.PARAMS_PER_CALL):
                self.client.log_batch(run_id, params=params[i:i + self.PARAMS_PER_CALL])
            self.client.log_dict(run_id, config, "config.json")
            if info is not None:
                self.client.log_dict(run_id, info, "run_info.json")
        else:
            try:
                self.client.update_run(run_id, status="RUNNING")
            except MlflowException as e:
                raise ConfigError(f"MLflow run {run_id} of {run_dir / STATE_FILE} is not in {self.uri} "
                                  f"({e.error_code}); set MLFLOW_TRACKING_URI to its store, or delete "
                                  f"{run_dir / STATE_FILE} to start a new MLflow run") from None
        self.run_id = run_id

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, int(record["iteration"])) for k, v in _numbers(record).items()]
        for i in range(0, len(metrics), self.METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.METRICS_PER_CALL])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def check_installed(names: list[str]) -> None:
    """A ConfigError naming the package of the first tracker of `names` that is not installed (a run checks
    before it writes anything)."""
    for name in names:
        if name != "tensorboard":
            _import_or_explain(name)


def _import_or_explain(name: str) -> None:
    import importlib.util

    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # (a module set to None in sys.modules: not importable)
        found = False
    if not found:
        raise ConfigError(f"train.trackers has {name}, which is not installed: pip install '{PACKAGES[name]}' (or "
                          f"pip install 't5forge[trackers]'), or remove {name} from train.trackers") from None


def _quiet_environment(uri_is_default_file_store: bool) -> None:
    """No usage telemetry from either library; MLflow's file store (in maintenance mode since MLflow 3) allowed
    where t5forge chose it."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("WANDB_SILENT", "true")
    if uri_is_default_file_store:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


class Trackers:
    """The trackers of a run, as one: `log(record)` to each (skipping the steps an interrupted attempt had
    logged already), `close()`."""

    def __init__(self, names: list[str], run_dir: Path, config: dict, info: dict | None, project: str,
                 resumed_at: int | None, logged_through: int):
        assert set(names) <= set(TRACKERS), names  # (the config checked them)
        check_installed(names)
        _quiet_environment("mlflow" in names and not os.environ.get("MLFLOW_TRACKING_URI"))
        self.logged_through = logged_through
        state_path = run_dir / STATE_FILE
        # Kept across restarts of the run, a crash before its first checkpoint included.
        try:
            state = json.loads(state_path.read_text(encoding="utf-8")) if state_path.is_file() else {}
        except (UnicodeDecodeError, ValueError):
            raise ConfigError(f"{state_path} is damaged; delete it (the trackers then start new runs)") from None
        self.trackers = []
        try:
            for name in names:
                if name == "tensorboard":
                    self.trackers.append(TensorBoardTracker(run_dir, config, info, resumed_at))
                elif name == "wandb":
                    run_id = state.setdefault("wandb", {}).setdefault("id", uuid.uuid4().hex[:12])
                    self.trackers.append(WandbTracker(run_dir, config, info, run_id, project))
                elif name == "mlflow":
                    saved = state.get("mlflow", {})
                    tracker = MlflowTracker(run_dir, config, info, saved.get("run_id"), project,
                                            saved.get("tracking_uri"))
                    state["mlflow"] = {"run_id": tracker.run_id, "tracking_uri": tracker.uri}
                    self.trackers.append(tracker)
        except BaseException:
            self.close(failed=True)
            raise
        if state:
            write_text_atomic(state_path, json.dumps(state, indent=1))

    def log(self, record: dict) -> None:
        for tracker in self.trackers:
            # TensorBoard purged what follows the resumed step: it takes every record again.
            if tracker.name == "tensorboard" or record["iteration"] > self.logged_through:
                tracker.log(record)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ended by an error (a stop signal too: the next start continues the tracker run)."""
        trackers, self.trackers, first_error = self.trackers, [], None
        for tracker in trackers:  # each one closed, whatever another raises
            try:
                tracker.close(failed)
            except Exception as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
