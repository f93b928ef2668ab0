"""The training loop: exact resume, loss normalisation across accumulation, precision, activation
checkpointing, metrics, checkpoints, HF export, `t5forge eval`, and bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_reference import load_hf_model
from step_hooks import AtStep

from t5forge.cli import main
from t5forge.config import load_config
from t5forge.data.loader import collate
from t5forge.errors import CheckpointError, ConfigError
from t5forge.train.trainer import Trainer, default_hooks, train

TINY_MODEL = [
    "model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
    "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
    "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=1",
]


def run_config(tmp_path, dataset_prefix, tokenizer_dir, *overrides, name="run"):
    return load_config(None, [
        *TINY_MODEL, f"data.dataset={dataset_prefix}", f"data.tokenizer={tokenizer_dir}", "data.inputs_length=64",
        "data.num_workers=0", f"train.output_dir={tmp_path / name}", "train.micro_batch_size=4",
        "train.max_steps=6", "train.log_period=1", "train.eval_period=0", "train.eval_samples=8",
        "train.save_period=0", "optim.lr=3e-3", "optim.schedule=cosine", "optim.warmup_steps=2", *overrides])


def quiet_train(run, **kwargs) -> Trainer:
    return train(run, echo=lambda *_: None, tensorboard=False, **kwargs)


class Crash(Exception):
    pass


def crash() -> None:
    """What a lost node does to a run."""
    raise Crash


def test_resumed_run_gives_bitwise_the_losses_of_the_uninterrupted_run(tmp_path, dataset_prefix, tokenizer_dir):
    common = ["model.dropout_rate=0.1", "train.global_batch_size=8", "optim.weight_decay=0.01",
              "train.save_period=3", "data.num_workers=1"]
    straight = quiet_train(run_config(tmp_path, dataset_prefix, tokenizer_dir, *common, name="straight"))

    crashed = Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, *common, name="resumed"), echo=lambda *_: None)
    crashed.run_dir.mkdir(exist_ok=True)  # (the trainer has made it: its lock is there)
    (crashed.run_dir / "config.yaml").write_text((straight.run_dir / "config.yaml").read_text()
                                                 .replace(str(straight.run_dir), str(crashed.run_dir)))
    with crashed, pytest.raises(Crash):  # checkpoint at step 3, crash after step 4
        crashed.run_training(default_hooks(crashed, tensorboard=False) + [AtStep(4, crash)])
    assert crashed.state.losses == straight.state.losses[:4]

    resumed = quiet_train(run_config(tmp_path, dataset_prefix, tokenizer_dir, *common, name="resumed"))
    assert resumed.state.losses == straight.state.losses[3:]  # bitwise, steps 4 to 6
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_loss_is_normalised_by_the_tokens_of_the_global_batch(tmp_path, dataset_prefix, tokenizer_dir):
    with Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.global_batch_size=8",
                                "optim.clip_grad_norm=0", "model.dropout_rate=0"), echo=lambda *_: None) as trainer:
        first, second = (collate([trainer.data.train[i] for i in range(j, j + 4)]) for j in (0, 4))
        first["labels"][:, 5:] = -100  # micro-batches with different numbers of target tokens
        whole = {k: torch.cat([first[k], second[k]]) for k in first}
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        grads = []
        trainer.optimizer.step = lambda *a, **k: grads.append([p.grad.clone() for p in trainer.model.parameters()])

        with torch.no_grad():
            reference = trainer.model(**whole).loss  # HF-style mean over every valid token of the global batch
        accumulated = float(trainer.train_step([first, second]))
        trainer.model.load_state_dict(start)
        single = float(trainer.train_step([whole]))
        assert accumulated == pytest.approx(reference.item(), rel=1e-6)
        assert single == pytest.approx(reference.item(), rel=1e-6)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_does_not_change_training(mode, tmp_path, dataset_prefix, tokenizer_dir):
    args = ("model.dropout_rate=0.1", "train.max_steps=3")
    plain = quiet_train(run_config(tmp_path, dataset_prefix, tokenizer_dir, *args, name="plain"))
    ac = quiet_train(run_config(tmp_path, dataset_prefix, tokenizer_dir, *args,
                                f"parallel.activation_checkpointing={mode}", name=mode))
    assert ac.state.losses == plain.state.losses
    for (name, a), b in zip(plain.model.state_dict().items(), ac.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_fp16_loss_scaling_skips_overflowing_steps_and_counts_them(tmp_path, dataset_prefix, tokenizer_dir):
    # An initial scale of 2^120 overflows fp16 gradients; each overflow skips the step and halves the scale.
    trainer = quiet_train(run_config(tmp_path, dataset_prefix, tokenizer_dir, "precision.dtype=fp16",
                                     "precision.initial_loss_scale=1.329228e36", "train.max_steps=4"))
    assert int(trainer.loss_scaler.skipped_steps) == 4
    assert all(torch.isfinite(torch.tensor(trainer.state.losses)))
    log = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in log if "skipped_steps" in r] == [1, 2, 3, 4]


def test_bf16_autocast_trains_close_to_fp32(tmp_path, dataset_prefix, tokenizer_dir):
    fp32 = quiet_train(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=2", name="fp32"))
    bf16 = quiet_train(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=2",
                                  "precision.dtype=bf16", name="bf16"))
    assert abs(bf16.state.losses[0] - fp32.state.losses[0]) < 0.05
    assert bf16.model.shared.weight.dtype == torch.float32  # fp32 master weights


def test_run_directory_holds_metrics_checkpoints_curve_and_an_hf_export(tmp_path, dataset_prefix, tokenizer_dir,
                                                                      capsys):
    lines = []
    run = run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.log_period=2", "train.eval_period=3",
                     "train.save_period=2", "train.keep_last=2")
    trainer = train(run, echo=lines.append, tensorboard=True)
    run_dir = trainer.run_dir
    pattern = (r"iteration: \d+/6 consumed_samples: \d+ loss: [\d.]+ time: [\d.]+ s/iter data_time: [\d.]+ s/iter "
               r"throughput: [\d.]+ samples/s tokens/s: \d+ tflops: [\d.]+ mfu: [\d.]+% mem: \d+ MiB lr: [\d.e+-]+ "
               r"eta: \d+:\d\d:\d\d")
    assert len([line for line in lines if re.fullmatch(pattern, line)]) == 4, lines
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in train_records] == [1, 2, 4, 6]
    assert set(train_records[0]) >= {"iteration", "consumed_samples", "loss", "lr", "samples_per_s", "tokens_per_s",
                                     "tflops", "mfu", "mem_mib", "time_s", "data_time_s", "skipped_steps"}
    assert train_records[-1]["consumed_samples"] == 24
    assert train_records[0]["tokens_per_s"] == pytest.approx(train_records[0]["samples_per_s"] * (64 + 14))
    assert [r["iteration"] for r in records if "valid_loss" in r] == [3, 6]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000004",
                                                                           "step_00000006"]
    assert (run_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "train:" in (run_dir / "config.yaml").read_text()

    # The export loads in transformers and computes our logits.
    hf = load_hf_model(run_dir / "hf")
    batch = next(iter(torch.utils.data.DataLoader([trainer.data.valid[0]], batch_size=1)))
    ours = trainer.model.eval()(input_ids=batch["input_ids"], labels=batch["labels"])
    ref = hf(input_ids=batch["input_ids"], labels=batch["labels"])
    torch.testing.assert_close(ours.logits, ref.logits, rtol=0, atol=1e-5)

    # `t5forge eval` reproduces the final validation loss from the checkpoint.
    assert main(["eval", str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(records[-1]["valid_loss"], rel=1e-6)
    assert result["checkpoint"].endswith("step_00000006")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_evaluation_gives_the_loss_and_accuracy_of_the_full_logits(precision, tmp_path, dataset_prefix,
                                                                   tokenizer_dir, monkeypatch):
    """Evaluated chunk by chunk through the head (7 tokens per chunk here), never the batch's logits: the loss
    per token and the argmax accuracy that cross-entropy and argmax of the full logits give."""
    import torch.nn.functional as F

    from t5forge.models import loss as loss_module
    from t5forge.train.forward import model_inputs

    run = run_config(tmp_path, dataset_prefix, tokenizer_dir, f"precision.dtype={precision}")
    with Trainer(run, echo=lambda *_: None) as trainer:  # untrained: argmax ties and hits are tested in test_loss
        model, valid = trainer.model, trainer.data.valid
        monkeypatch.setattr(loss_module, "CHUNK_LOGITS", 7 * model.config.vocab_size)
        result = trainer.validate()
    model.eval()
    loss = tokens = correct = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        for start in range(0, result["samples"], 4):
            batch = collate([valid[i] for i in range(start, start + 4)])
            logits, labels = model(**model_inputs(model, batch)).logits, batch["labels"]
            loss += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").item()
            tokens += (labels != -100).sum().item()
            correct += ((logits.argmax(-1) == labels) & (labels != -100)).sum().item()
    assert result["tokens"] == tokens
    assert result["loss"] == pytest.approx(loss / tokens, rel=1e-6)
    assert result["accuracy"] == correct / tokens


def test_config_errors_name_the_key(tmp_path, dataset_prefix, tokenizer_dir):
    with pytest.raises(ConfigError, match="did you mean train.micro_batch_size"):
        run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.micro_bach_size=3")
    with pytest.raises(ConfigError, match=r"global_batch_size \(10\) must be a multiple of .* = 4 x 1 = 4"):
        run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.global_batch_size=10")
    with pytest.raises(ConfigError, match="wrong type for 'optim.lr'"):
        run_config(tmp_path, dataset_prefix, tokenizer_dir, "optim.lr=fast")
    yaml = tmp_path / "bad.yaml"
    yaml.write_text("train:\n  max_step: 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'train.max_step'; did you mean train.max_steps"):
        load_config(yaml)


def test_bad_runs_are_refused_before_training(tmp_path, dataset_prefix, tokenizer_dir):
    with pytest.raises(ConfigError, match="tokenizer in .* has 2100 ids but the model's vocab_size is 1000"):
        Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "model.overrides.vocab_size=1000"))
    with pytest.raises(ConfigError, match="targets_length=20 does not follow"):
        Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "data.targets_length=20"))
    with pytest.raises(ConfigError, match=r"dp x tp x pp = 2 x 1 x 1 = 2, but 1 process\(es\) are running"):
        Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "parallel.dp=2"))
    with pytest.raises(Exception, match="does not exist"):
        Trainer(run_config(tmp_path, tmp_path / "nope", tokenizer_dir))

    quiet_train(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=1"))
    with pytest.raises(ConfigError, match=r"holds checkpoints of another run \(train.seed: 1234 -> 7\)"):
        Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.seed=7"))
    with pytest.raises(ConfigError, match="train.resume=never would overwrite"):
        Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.resume=never"))

    data_file = next((tmp_path / "run" / "checkpoints" / "step_00000001").glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*step_00000001/__0_0.distcp has 100 bytes, "
                                              r"the manifest says \d+"):
        Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir))


def test_cli_train_reports_bad_config_with_exit_2(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  preset: t5-smal\n")
    assert main(["train", str(config), "train.output_dir=x", "train.max_steps=1", "data.dataset=d",
                 "data.tokenizer=t"]) == 2
    err = capsys.readouterr().err
    assert "unknown model preset 't5-smal'" in err and err.count("\n") == 1
