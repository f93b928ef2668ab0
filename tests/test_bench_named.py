"""Named benchmarks: the name grammar (every field, every error pointing at its field) and a tiny real run
with and without transformers as the baseline."""

from __future__ import annotations

import json
import shlex
import shutil
import sys

import pytest

from t5forge.bench import SUITES
from t5forge.bench.names import parse_bench_name, run_overrides
from t5forge.bench.training import PhaseRanges, run_named_benchmarks
from t5forge.cli import main
from t5forge.errors import ConfigError


def test_libai_name_parses_into_a_run():
    bench = parse_bench_name("t5_nl12_nah12_hs768_FP16_actrue_mp2_pp1_mb32_gb512_1n4g")
    assert (bench.family, bench.num_layers, bench.num_heads, bench.d_model) == ("t5", 12, 12, 768)
    assert (bench.precision, bench.activation_checkpointing, bench.tp, bench.pp) == ("fp16", "full", 2, 1)
    assert (bench.micro_batch_size, bench.global_batch_size, bench.nodes, bench.devices) == (32, 512, 1, 4)
    assert bench.dp == 2 and bench.target_tokens() == 114
    model = bench.model_overrides()
    assert model["d_ff"] == 3072 and model["d_kv"] == 64 and model["vocab_size"] == 32128
    assert model["feed_forward_proj"] == "relu" and model["tie_word_embeddings"]
    overrides = run_overrides(bench)
    assert "parallel.dp=2" in overrides and "parallel.tp=2" in overrides and "precision.dtype=fp16" in overrides


def test_optional_fields():
    bench = parse_bench_name("mt5_nl8_ndl4_nah6_hs512_ffn1024_kv64_vocab250112_seq1024_tgt256_zero1_spfalse_"
                             "acselective_BF16_mb2_gb8_2n2g")
    assert bench.model_overrides()["num_decoder_layers"] == 4 and bench.model_overrides()["model_type"] == "mt5"
    assert (bench.inputs_length, bench.target_tokens(), bench.zero_stage) == (1024, 256, 1)
    assert bench.activation_checkpointing == "selective" and bench.dp == 4
    gated = parse_bench_name("t5v11_nl8_nah6_hs512_FP32_mb2_gb2_1n1g").model_overrides()
    assert gated["d_ff"] == 1280 and not gated["tie_word_embeddings"]  # 2.5 x 512


@pytest.mark.parametrize("name, message", [
    ("gpt_nl12_nah12_hs768_FP16_mb32_gb512_1n4g", r"field 'gpt' is not a model family"),
    ("t5_nl12_nah12_hs768_FP16_mb32_gb512_1n4g_xyz7", r"field 'xyz7' is not a known field"),
    ("t5_nl12_nah12_hs768_FP16_acmaybe_mb32_gb512_1n4g", r"field 'acmaybe' has activation checkpointing 'maybe'"),
    ("t5_nl12_nl6_nah12_hs768_FP16_mb32_gb512_1n4g", r"field 'nl6' repeats a field"),
    ("t5_nl12_nah12_hs768_FP16_mb32_gb512_1n4g_hs-1", r"field 'hs-1' is not FIELD<number>"),
    ("t5_nl0_nah12_hs768_FP16_mb32_gb512_1n4g", r"field 'nl0' must be a positive number"),
    ("t5_nl12_hs768_FP16_mb32_gb512_1n4g", r"lacks nah<N>"),
    ("t5_nl12_nah12_hs768_mb32_gb512", r"lacks FP32/FP16/BF16, <nodes>n<devices>g"),
    ("t5_nl12_nah12_hs768_FP16_mp3_mb32_gb512_1n4g", r"4 processes is not divisible by mp3 x pp1"),
    ("t5_nl12_nah12_hs768_FP16_mb32_gb500_1n4g", r"gb500 is not a multiple of mb32 x dp4 = 128"),
    ("t5_nl12_nah12_hs768_FP16_zero4_mb32_gb512_1n4g", r"field 'zero4' must be 0, 1, 2 or 3"),
])
def test_malformed_names_point_at_the_field(name, message):
    with pytest.raises(ConfigError, match=message):
        parse_bench_name(name)


def test_cli_refuses_a_bad_name_with_exit_2(capsys, tmp_path):
    assert main(["bench", "t5_nl2_nah2_hs64_FP99_mb2_gb2_1n1g", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "field 'FP99' is not a known field" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())
    # key=value arguments set t5forge's train.* options only: the name fixes the rest.
    assert main(["bench", "t5_nl2_nah2_hs64_FP32_mb2_gb4_1n2g", "model.overrides.d_model=8", "--output",
                 str(tmp_path)]) == 2
    assert "bench override 'model.overrides.d_model=8': only train.KEY=VALUE" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


TINY = "t5v11_nl2_nah4_hs32_ffn64_kv8_vocab2176_seq32_FP32_mb2_gb4_1n1g"


@pytest.fixture
def work(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "work: #1"  # YAML syntax in the path: the run config must quote it
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")  # 2000 pieces: fits the tiny vocabulary
    return work


def test_tiny_run_without_baseline_and_its_profile(work, tmp_path):
    run_named_benchmarks([TINY], tmp_path / "out", work, steps=2, command="test", profile=True,
                         overrides=["train.fused_loss=false"])
    result = json.loads((tmp_path / "out" / "named.json").read_text())
    assert result["overrides"] == ["train.fused_loss=false"]
    entry = result["benchmarks"][TINY]
    assert list(entry["results"]) == ["t5forge"] and "ratio_samples_per_s" not in entry
    ours = entry["results"]["t5forge"]
    assert ours["samples_per_s"] > 0 and ours["tflops"] > 0 and 0 < ours["mfu"] < 1
    assert ours["peak_memory_mib"] > 0 and len(ours["losses"]) == 4  # 2 warm-up + 2 timed
    assert (tmp_path / "out" / "named.png").stat().st_size > 1000
    assert result["command"] == "test" and result["machine"]["torch"]
    # The profile: profiler ranges of every phase of one step, together nearly the whole step.
    profile = entry["profile"]
    assert {"data", "forward encoder", "forward decoder", "loss", "backward", "optimizer"} <= set(profile["phases"])
    assert 0.8 < sum(profile["phases"].values()) <= 1.0
    assert profile["phases"]["backward"] > profile["phases"]["loss"]
    assert profile["collectives"] == {}  # one process: none
    trace = json.loads((tmp_path / "out" / f"{TINY}.trace.json").read_text())
    assert any(e.get("name") == "phase: backward" for e in trace["traceEvents"])
    assert "Profile of one t5forge step" in (tmp_path / "out" / "named.md").read_text()


def test_tiny_run_against_transformers_uses_the_same_weights_and_batches(work, tmp_path):
    run_named_benchmarks([TINY], tmp_path / "out", work, steps=2, baseline="hf", command="test")
    result = json.loads((tmp_path / "out" / "named.json").read_text())
    entry = result["benchmarks"][TINY]
    ours, theirs = entry["results"]["t5forge"], entry["results"]["hf"]
    # Same weights, batches and optimizer: the same first loss (mean token cross-entropy, no padding)
    # and the same trajectory while float rounding stays small.
    assert ours["losses"][0] == pytest.approx(theirs["losses"][0], rel=1e-5)
    assert ours["losses"][-1] == pytest.approx(theirs["losses"][-1], rel=1e-3)
    assert entry["ratio_samples_per_s"] == pytest.approx(ours["samples_per_s"] / theirs["samples_per_s"])
    assert entry["ratio_peak_memory"] == pytest.approx(ours["peak_memory_mib"] / theirs["peak_memory_mib"])
    text = (tmp_path / "out" / "named.md").read_text()
    assert "samples/s t5forge / transformers" in text and TINY in text


def test_the_recorded_command_comes_from_the_arguments_not_sys_argv(work, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pytest", "-q", "unrelated"])  # main(argv) called inside another program
    out = tmp_path / "out"
    argv = ["bench", TINY, "train.fused_loss=false", "--steps", "1", "--output", str(out), "--work-dir", str(work)]
    assert main(argv) == 0
    assert json.loads((out / "named.json").read_text())["command"] == (
        f"t5forge bench {TINY} train.fused_loss=false --steps 1 --output {shlex.quote(str(out))} "
        f"--work-dir {shlex.quote(str(work))}")


def test_suites_run_from_the_registry_and_its_descriptions_are_the_help(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_suite(output_dir, work_dir):
        calls.append((output_dir, work_dir))
        (tmp_path / "data.md").write_text("# data results\n")

    monkeypatch.setitem(SUITES, "data", (fake_suite, "a fake suite"))
    assert main(["bench", "data", "--output", str(tmp_path), "--work-dir", "w"]) == 0
    assert calls == [(str(tmp_path), "w")] and "# data results" in capsys.readouterr().out
    assert main(["bench", "data", "pipeline"]) == 2 and "run one suite" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "100000")  # argparse wraps at the terminal's width (and breaks at hyphens)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(f"{name}: {' '.join(description.split())}" in help_text for name, (_, description) in SUITES.items())


def test_profiler_ranges_have_no_phase_before_the_first():
    assert PhaseRanges(None).phase is None
