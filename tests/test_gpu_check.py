"""scripts/gpu_check.sh, the one place where GPU behaviour is proven, keeps working: its CPU dry run
(tiny shapes, same steps) passes and writes the report a GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_gpu_check_dry_run_on_the_cpu_passes_and_reports(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", "--output", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["passed"] and report["mode"] == "cpu dry run"
    checks = report["checks"]
    assert set(checks) == {"parity", "train_bf16", "fp16_loss_scaling", "checkpoint_resume", "hf_export",
                           "comm_audit", "bench_vs_transformers"}
    assert checks["comm_audit"]["seen"] == [["all_reduce", "world", "backward", 4 << 20]]
    assert checks["parity"]["fp32_logits_max_abs_diff"] < 1e-5 and checks["parity"]["fp32_grad_max_rel_diff"] < 1e-5
    assert checks["train_bf16"]["samples_per_s"] > 0 and checks["train_bf16"]["peak_memory_mib"] > 0
    assert checks["train_bf16"]["sync_debug"].startswith("skipped: ")  # said, not silently dropped
    assert checks["fp16_loss_scaling"]["skipped_steps"] == checks["fp16_loss_scaling"]["steps"]
    assert checks["checkpoint_resume"]["bitwise"]
    bench = checks["bench_vs_transformers"]
    assert abs(bench["first_losses"][0] - bench["first_losses"][1]) < 1e-4  # same weights and batch
    assert bench["ratio_samples_per_s"] > 0 and set(bench["targets_met"]) == {"mfu", "ratio_samples_per_s"}
    assert (tmp_path / "out" / "bench" / "named.md").is_file()
    assert not list(tmp_path.glob("t5forge-gpu-check-*"))  # its work directory is removed
