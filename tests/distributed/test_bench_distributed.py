import json
import shutil

import pytest
import torch

from t5forge.bench.distributed import run_distributed_benchmark
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration


@pytest.mark.e2e  # five launches of the whole benchmark, t5-small among them: ~4 minutes of the 2-core budget
def test_distributed_benchmark_measures_each_layout_in_its_own_launch(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "work: #1"  # YAML syntax in the path: the run config must quote it
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    model = T5ForConditionalGeneration(T5Config(vocab_size=2176, d_model=32, d_kv=8, d_ff=64, num_heads=4,
                                                num_layers=1, feed_forward_proj="gated-gelu",
                                                tie_word_embeddings=False, model_type="mt5"))
    model.init_weights(torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "hf")
    layouts = {"single process": (1, []), "dp2, ZeRO-3": (2, ["parallel.dp=2", "parallel.zero_stage=3"])}
    run_distributed_benchmark(
        tmp_path / "out", work, layouts=layouts, steps=1,
        overlap_layouts={"dp2, ZeRO-1, overlapped": (2, ["parallel.dp=2", "parallel.zero_stage=1"])}, overlap_steps=2,
        load_layouts={"dp2, ZeRO-3": (2, ["parallel.dp=2", "parallel.zero_stage=3"])}, load_checkpoint=tmp_path / "hf",
        step_layouts={"dp2, ZeRO-1": (2, ["parallel.dp=2", "parallel.zero_stage=1"])}, step_checkpoint=tmp_path / "hf",
        step_t5_small=False)
    result = json.loads((tmp_path / "out" / "distributed.json").read_text())
    single = result["layouts"]["single process"]["largest_rank"]
    zero3 = result["layouts"]["dp2, ZeRO-3"]
    assert len(zero3["ranks"]) == 2
    # ZeRO-3 over two ranks holds half of every part of the model state (t5-small splits evenly).
    for key in ("parameters_mib", "gradients_mib", "optimizer_mib"):
        assert abs(zero3["largest_rank"][key] * 2 - single[key]) < 0.01 * single[key], key
    # ZeRO-1 reduces every gradient element exactly once per step: t5-small's published parameter count.
    overlap = result["overlap"]["layouts"]["dp2, ZeRO-1, overlapped"]
    assert overlap["grad_reduced_elements"] == 60_506_624
    assert 0 <= overlap["grad_wait_s"] <= overlap["step_s"]
    # Each of two ZeRO-3 ranks holds half of the loaded model.
    held = [r["held_mib"] for r in result["loading"]["layouts"]["dp2, ZeRO-3"]["ranks"]]
    full = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    assert all(abs(h * 2 - full) < 0.01 * full for h in held), (held, full)
    # The training step from the checkpoint: ZeRO-1 ranks hold half of AdamW's two fp32 moments each, and the
    # step's peak of live tensors holds at least the parameters, gradients and optimizer state at once.
    step, = result["step"]["models"].values()
    ranks = step["dp2, ZeRO-1"]["ranks"]
    moments = 2 * full
    assert all(abs(r["optimizer_mib"] * 2 - moments) < 0.05 * moments for r in ranks), ranks
    for r in ranks:
        assert r["step_peak_mib"] >= r["parameters_mib"] + r["gradients_mib"] + r["optimizer_mib"], r
    text = (tmp_path / "out" / "distributed.md").read_text()
    assert "| dp2, ZeRO-3 | 2 |" in text and "| dp2, ZeRO-1, overlapped |" in text
    assert "## Training step:" in text and "| dp2, ZeRO-1 | 2 |" in text


def test_live_tensor_peak_on_a_cpu_counts_the_tensors_alive_together():
    """8 MB held on entry, then 8 + 16 MB alive at once at most: 32 MB, however much was freed between."""
    from t5forge.train.metrics import LiveTensorPeak

    with LiveTensorPeak(torch.device("cpu"), held_bytes=8 * 10**6) as peak:
        a = torch.empty(2 * 10**6)
        b = torch.empty(4 * 10**6)
        del a, b
        c = torch.empty(10**6)
        del c
    assert abs(peak.mib * 2**20 - 32 * 10**6) < 10**4, peak.mib
