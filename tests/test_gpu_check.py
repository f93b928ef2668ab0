"""scripts/gpu_check.sh, the one place where GPU behaviour is proven, keeps working, on the GPU machine's terms:
its CPU dry run passes with the packages that machine's image lacks hidden (brought from a stand-in for
.gpu-deps) and with CUDA's sync debug mode emulated (tests/gpu_emulation/sitecustomize.py), and writes the
report a GPU run writes. Without the packages it stops at once with one line naming them all."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from t5forge.train.hooks import Hook

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
EMULATION = Path(__file__).parent / "gpu_emulation"
CHECKS = {"prepare_data", "parity", "train_bf16", "fp16_loss_scaling", "checkpoint_resume", "hf_export", "comm_audit",
          "generation", "finetune_eval", "activation_checkpointing", "fake_pg_world8", "dry_run_cuda", "dp2_gloo", "compile",
          "bench_vs_transformers"}


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


preflight = load(ROOT / "scripts" / "gpu_preflight.py", "gpu_preflight")


def gpu_image_env(tmp_path: Path, deps: Path) -> dict:
    """The environment of a gpu_check.sh run on the emulated GPU image, with `deps` as its .gpu-deps."""
    return {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(EMULATION), "T5FORGE_EMULATE_GPU_IMAGE": "1", "T5FORGE_EMULATE_SYNC_DEBUG": "1",
            "T5FORGE_GPU_DEPS": str(deps), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}


def stand_in_gpu_deps(folder: Path) -> Path:
    """What scripts/gpu_deps.sh brings (without matplotlib), as links into this venv's site-packages: the
    distributions that provide the packages of gpu_preflight.BROUGHT. No network."""
    folder.mkdir()
    for requirements in preflight.BROUGHT.values():
        dist = importlib.metadata.distribution(requirements[0].split("==")[0])
        files = [f for f in dist.files if f.parts[0] != ".." and not f.parts[0].endswith(".dist-info")]
        for top in {f.parts[0] for f in files}:
            source = Path(dist.locate_file(top))
            if source.is_dir() and not (source / "__init__.py").exists() and top.isidentifier():
                # A namespace package (google): a folder of its own, with links to this distribution's parts.
                (folder / top).mkdir(exist_ok=True)
                for part in {f.parts[1] for f in files if f.parts[0] == top and len(f.parts) > 2}:
                    (folder / top / part).symlink_to(source / part)
            else:
                (folder / top).symlink_to(source)
    (folder / "T5FORGE_GPU_DEPS_PYTHON").write_text("%d.%d\n" % sys.version_info[:2])
    return folder


def test_gpu_check_stops_at_once_naming_every_package_the_gpu_image_lacks(tmp_path):
    env = gpu_image_env(tmp_path, deps=tmp_path / "no-gpu-deps")
    result = subprocess.run([str(SCRIPT), "--cpu", "--output", str(tmp_path / "out")], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for package in preflight.BROUGHT:  # all of them at once, not the first one met
        assert preflight.PROBES.get(package, package) in lines[0]
    assert "scripts/gpu_deps.sh" in lines[0] and "matplotlib" not in lines[0]  # plots are optional
    assert not (tmp_path / "out").exists()  # nothing started


def load_gpu_check(monkeypatch):
    # Importing the script sets two environment variables of its own process: restored after the test.
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    return load(ROOT / "scripts" / "gpu_check.py", "gpu_check_under_test")


def test_every_check_is_reported_when_others_raise_crash_or_hang(tmp_path, monkeypatch):
    gpu_check = load_gpu_check(monkeypatch)

    def raises(ctx):
        raise ValueError("broken")

    def hangs(ctx):
        time.sleep(60)

    def dies(ctx):  # as a process killed by a CUDA fault
        os.kill(os.getpid(), signal.SIGKILL)

    outcomes = {"raises": raises, "hangs": hangs, "dies": dies, "fails": lambda ctx: {"passed": False, "x": 1},
                "passes": lambda ctx: {"passed": True, "answer": 42}}
    checks = [gpu_check.Check(name, run, 1, 2, 2, needs_data=False) for name, run in outcomes.items()]
    (tmp_path / "work").mkdir()
    ctx = gpu_check.Context(cpu=True, work=tmp_path / "work", output=tmp_path, steps=1, sync_debug=False)
    report = {"checks": {}}
    gpu_check.run_checks(checks, ctx, report, tmp_path / "gpu_check.json", budget=60)
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {name: c["status"] for name, c in written["checks"].items()} == {
        "raises": "error", "hangs": "timeout", "dies": "error", "fails": "failed", "passes": "passed"}
    assert written["checks"]["raises"]["error"] == "ValueError: broken"
    assert "signal 9" in written["checks"]["dies"]["error"]
    assert written["checks"]["passes"]["answer"] == 42 and all(c["seconds"] >= 0 for c in written["checks"].values())
    assert written["counts"] == {"passed": 1, "failed": 1, "error": 2, "skipped": 0, "timeout": 1}
    assert not written["passed"]


def test_sync_guard_covers_the_train_step_alone_and_the_emulation_catches_reads_under_it(monkeypatch):
    gpu_check = load_gpu_check(monkeypatch)
    undo = load(EMULATION / "sitecustomize.py", "gpu_emulation").install_sync_emulation(torch)
    try:
        class Step:
            def __init__(self, read: bool):
                self.read = read

            def train_step(self, micro_batches):
                loss = torch.ones(()) * 2
                return torch.tensor(loss.item()) if self.read else loss  # .item(): a host read inside the step

        quiet = Step(read=False)
        guard = gpu_check.SyncDebug(quiet, warmup=1)
        quiet.train_step([])  # warm-up: not guarded
        loss = quiet.train_step([])
        assert loss.item() == 2.0  # a hook's read after the step is allowed again
        assert guard.guarded_steps == 1 and torch.cuda.get_sync_debug_mode() == 0

        reading = Step(read=True)
        gpu_check.SyncDebug(reading, warmup=0)
        with pytest.raises(RuntimeError, match="synchronizing"):
            reading.train_step([])
        assert torch.cuda.get_sync_debug_mode() == 0  # reset when the step raises

        # The ordering this replaced: a hook that turned "error" on after the step, before the next hooks of the
        # same step read the device (LogHook's .item() / .tolist()), which CUDA refuses.
        class OldGuard(Hook):
            def after_step(self, info):
                torch.cuda.set_sync_debug_mode("error")

        class Reader(Hook):
            def after_step(self, info):
                info.item()

        with pytest.raises(RuntimeError, match="Tensor.item"):
            for hook in (OldGuard(), Reader()):
                hook.after_step(torch.ones(()))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        undo()


@pytest.mark.e2e  # the suite's one large dry run: every check of the GPU machine, ~2 minutes of both cores
def test_gpu_check_dry_run_passes_on_the_emulated_gpu_image_and_reports_every_check(tmp_path):
    """The one dry run of the suite: packages of the GPU image's kind (matplotlib hidden and not brought), the
    sync guard on with CUDA's behaviour emulated, every check passed and recorded."""
    env = gpu_image_env(tmp_path, stand_in_gpu_deps(tmp_path / "gpu-deps"))
    out = tmp_path / "out"
    result = subprocess.run([str(SCRIPT), "--cpu", "--sync-debug", "--output", str(out)], capture_output=True,
                            text=True, env=env, timeout=900)
    report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").is_file() else {}
    failed = {n: c.get("error") for n, c in report.get("checks", {}).items() if c["status"] != "passed"}
    assert result.returncode == 0, (failed, result.stdout[-3000:], result.stderr[-3000:])
    assert report["passed"] and report["mode"] == "cpu dry run" and report["budget_s"] > 0
    checks = report["checks"]
    assert set(checks) == CHECKS and not failed
    assert all(c["error"] is None and c["seconds"] > 0 for c in checks.values())
    assert report["counts"]["passed"] == len(CHECKS)
    assert checks["comm_audit"]["seen"] == [["all_reduce", "world", "backward", 4 << 20]]
    parity = checks["parity"]
    assert parity["fp32_logits_max_abs_diff"] < 1e-5 and parity["fp32_grad_max_rel_diff"] < 1e-5
    assert parity["fp32_logits_max_abs"] > 0  # the scale its tolerance is relative to
    assert checks["train_bf16"]["samples_per_s"] > 0 and checks["train_bf16"]["peak_memory_mib"] > 0
    # The guard ran inside the steps (the emulation raises on any host read there) and said so.
    assert checks["train_bf16"]["sync_guarded_steps"] == checks["train_bf16"]["steps"] - 3
    assert checks["fp16_loss_scaling"]["sync_guarded_steps"] == checks["fp16_loss_scaling"]["steps"] - 1
    assert "emulated" in checks["train_bf16"]["sync_debug"]
    assert checks["fp16_loss_scaling"]["skipped_steps"] == checks["fp16_loss_scaling"]["steps"]
    assert checks["checkpoint_resume"]["bitwise"]
    assert checks["generation"]["identical_rows"] == checks["generation"]["rows"]
    assert checks["finetune_eval"]["evaluated_at"] == [0, 2, 4]
    assert all(d == 0 for d in checks["activation_checkpointing"]["max_rel_diff"].values())
    fake = checks["fake_pg_world8"]
    assert fake["steps_run"] == 2 and fake["layout"]["world_size"] == 8 and fake["layout"]["tp"] == 4
    assert fake["dp8_vocab_split"]["steps_run"] == 2 and "split over dp=8" in fake["dp8_vocab_split"]["vocabulary"]
    assert checks["dp2_gloo"]["max_rel_diff"] < 1e-5 and len(checks["dp2_gloo"]["losses_dp2"]) == 4
    assert checks["compile"]["max_rel_diff"] < 1e-5 and "compile_counters" in checks["compile"]
    bench = checks["bench_vs_transformers"]
    assert abs(bench["first_losses"][0] - bench["first_losses"][1]) < 1e-4  # same weights and batch
    assert bench["ratio_samples_per_s"] > 0 and set(bench["targets_met"]) == {"mfu", "ratio_samples_per_s"}
    # matplotlib is hidden: each plot is skipped with one line, the reports are complete.
    assert "loss curve: skipped, matplotlib is not installed" in result.stdout
    assert "named.png: skipped, matplotlib is not installed" in result.stdout
    assert (out / "bench" / "named.md").is_file() and not (out / "bench" / "named.png").exists()
    assert "Traceback" not in result.stdout + result.stderr
    assert not list(tmp_path.glob("t5forge-gpu-check-*"))  # its work directory is removed
    print(f"gpu_check --cpu: {report['seconds']} s")
