"""The `t5forge` command: argument parsing, dispatch to the library, and error mapping. Each subcommand is a
thin wrapper over the library; this is the only place that turns t5forge errors into a one-line message and
exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_USER_ERROR = 2
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def _load_config(name_or_dir: str):
    from t5forge.models.hf import config_from_hf, read_hf_config
    from t5forge.models.presets import get_preset

    if Path(name_or_dir).is_dir():
        return config_from_hf(read_hf_config(name_or_dir))
    return get_preset(name_or_dir)


def cmd_info(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from t5forge.models.summary import human_count, summarize

    config = _load_config(args.model)
    s = summarize(config)
    if args.json:
        print(json.dumps({
            "model_type": s.model_type, "variant": s.variant, "parameters": s.parameters,
            "embedding": s.embedding, "encoder": s.encoder, "decoder": s.decoder, "lm_head": s.lm_head,
            "non_embedding": s.non_embedding, "config": config.to_dict(),
            "training_memory_gib": {"fp32": s.training_gib(False), "mixed": s.training_gib(True)},
        }, indent=2))
        return 0
    c = config
    console = Console()
    console.print(f"[bold]{args.model}[/bold]: {s.variant}, {human_count(s.parameters)} parameters "
                  f"({s.parameters:,})")
    console.print(f"  d_model {c.d_model}, d_ff {c.d_ff}, heads {c.num_heads} x d_kv {c.d_kv}, "
                  f"layers {c.num_layers} encoder + {c.num_decoder_layers} decoder, vocab {c.vocab_size}, "
                  f"FFN {c.feed_forward_proj}, head {'tied' if c.tie_word_embeddings else 'untied'}")
    parts = Table(title="parameters", show_header=True)
    parts.add_column("part")
    parts.add_column("count", justify="right")
    parts.add_column("share", justify="right")
    for name, n in (("embedding (shared)", s.embedding), ("encoder", s.encoder), ("decoder", s.decoder),
                    ("lm_head", s.lm_head)):
        parts.add_row(name, f"{n:,}", f"{100 * n / s.parameters:.1f}%")
    console.print(parts)
    memory = Table(title="memory of model state per replica, GiB (activations not included)")
    memory.add_column("")
    for col in ("weights", "gradients", "optimizer", "half weights", "total"):
        memory.add_column(col, justify="right")
    fp32, mixed = s.training_gib(False), s.training_gib(True)
    memory.add_row("inference bf16", f"{s.weights_gib(2):.2f}", "", "", "", f"{s.weights_gib(2):.2f}")
    memory.add_row("train fp32 AdamW", *(f"{fp32[k]:.2f}" if k in fp32 else "" for k in
                                         ("weights", "gradients", "optimizer", "half weights", "total")))
    memory.add_row("train bf16/fp16 AdamW", *(f"{mixed[k]:.2f}" for k in
                                              ("weights", "gradients", "optimizer", "half weights", "total")))
    console.print(memory)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from t5forge.errors import CheckpointError
    from t5forge.models.hf import from_pretrained, save_pretrained
    from t5forge.train.checkpoint import (
        is_dcp_checkpoint,
        load_model_checkpoint,
        save_model_checkpoint,
    )

    src, dst = Path(args.source), Path(args.output)
    if not src.exists():
        raise CheckpointError(f"{src} does not exist; pass an HF model directory or a t5forge checkpoint")
    if src.resolve() == dst.resolve():
        raise CheckpointError("source and output are the same path; write the conversion somewhere else")
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    model = load_model_checkpoint(src, dtype) if is_dcp_checkpoint(src) else from_pretrained(src, dtype)
    if args.to == "hf":
        from t5forge.fileio import atomic_directory

        with atomic_directory(dst) as staging:
            save_pretrained(model, staging, max_shard_size=args.max_shard_size)
    else:
        save_model_checkpoint(model, dst)
    print(f"wrote {args.to} checkpoint {dst} ({model.config.model_type}, {model.num_parameters():,} parameters)")
    return 0


def cmd_corpus(args: argparse.Namespace) -> int:
    from t5forge.data.corpus import write_docstring_task, write_python_docs

    if args.name in ("python-functions", "python-modules"):
        target = args.name.removeprefix("python-").removesuffix("s")
        examples, size = write_docstring_task(args.output, target)
        print(f"wrote {args.output}: {examples} docstring sentence -> {target} name examples, {size / 1e6:.2f} MB "
              "(JSONL input/target, PSF licence)")
        return 0
    documents, size = write_python_docs(args.output)
    print(f"wrote {args.output}: {documents} documents, {size / 1e6:.2f} MB (Python documentation, PSF licence)")
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from t5forge.data.tokenizer import TRAINING_JSON, group_inputs, train_tokenizer, training_summary

    size = {} if args.input_sentence_size is None else {"input_sentence_size": args.input_sentence_size}
    tokenizer = train_tokenizer(group_inputs(args.input), args.vocab_size, args.output,
                                character_coverage=args.character_coverage, seed=args.seed,
                                temperature=args.temperature, **size)
    print(f"wrote {args.output}: {tokenizer.vocab_size} ids ({args.vocab_size} pieces + "
          f"{len(tokenizer.sentinel_ids)} sentinels); a model needs vocab_size >= {tokenizer.vocab_size}")
    print("\n".join(training_summary(args.output)) + f"\n(in {args.output}/{TRAINING_JSON})")
    return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from t5forge.data.preprocess import merge_datasets, preprocess
    from t5forge.errors import ConfigError

    if args.merge:
        if args.input:
            raise ConfigError("give either --input (text to tokenize) or --merge (datasets to join), not both")
        info = merge_datasets(args.merge, args.output)
        print(f"wrote {args.output}.bin/.idx/.json: {len(args.merge)} datasets joined, {info['documents']} documents, "
              f"{info['tokens']} tokens")
        return 0
    if not args.input or not args.tokenizer:
        raise ConfigError("preprocess needs --input FILE... and --tokenizer DIR (or --merge PREFIX... to join "
                          "datasets)")
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TextColumn("{task.fields[documents]:,} documents"), TimeRemainingColumn(),
                  disable=not sys.stderr.isatty(), console=None) as bar:
        task = bar.add_task("tokenizing", total=None, documents=0)
        stats = preprocess(args.input, args.tokenizer, args.output, workers=args.workers,
                           json_key=args.json_key, skip_bad_lines=args.skip_bad_lines, shard_size=args.shard_size,
                           progress=lambda done, total, documents: bar.update(task, completed=done, total=total,
                                                                              documents=documents))
    skipped = f", skipped {stats.skipped_lines} bad lines" if stats.skipped_lines else ""
    resumed = f"; resumed after {stats.resumed_shards} of {stats.shards} shards" if stats.resumed_shards else ""
    print(f"wrote {args.output}.bin/.idx/.json: {stats.documents} documents, {stats.tokens} tokens{skipped}; "
          f"{stats.mb_per_s:.2f} MB/s, {stats.tokens_per_s:,.0f} tokens/s with {args.workers} worker(s){resumed}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import shlex

    from t5forge.bench import SUITES
    from t5forge.errors import ConfigError

    if any(name in SUITES for name in args.names):
        if len(args.names) > 1:
            raise ConfigError(f"run one suite ({', '.join(SUITES)}) at a time, or benchmark names only")
        suite = args.names[0]
        run, _ = SUITES[suite]
        run(args.output_dir, args.work_dir)
        print((Path(args.output_dir) / f"{suite}.md").read_text())
        print(f"wrote {args.output_dir}/{suite}.json and {suite}.md")
        return 0
    from t5forge.bench.training import run_named_benchmarks

    # From the parsed arguments, not sys.argv: main(argv) may run inside another program.
    command = shlex.join(["t5forge", "bench", *args.names, *(["--baseline", args.baseline] if args.baseline else []),
                          "--steps", str(args.steps), *(["--profile"] if args.profile else []),
                          "--output", args.output_dir, "--work-dir", args.work_dir])
    run_named_benchmarks([item for item in args.names if "=" not in item], args.output_dir, args.work_dir,
                         steps=args.steps, baseline=args.baseline, command=command, profile=args.profile,
                         overrides=[item for item in args.names if "=" in item])
    print((Path(args.output_dir) / "named.md").read_text())
    written = ["named.json", "named.md"] + (["named.png"] if (Path(args.output_dir) / "named.png").is_file() else [])
    print(f"wrote {args.output_dir}/{', '.join(written)}")
    return 0


def _relaunch(nproc_per_node: int, command: list[str], max_restarts: int = 0) -> int:
    """Convenience for one machine: run `t5forge COMMAND ...` under torchrun with N processes (restarted up to
    `max_restarts` times when a rank dies: they resume from the newest complete checkpoint); returns the
    exit status of the first failing rank (which printed its own error), else 0."""
    from t5forge.lifecycle import launch

    return launch(["t5forge", *command], nproc_per_node, max_restarts=max_restarts)[0].returncode


def _check_process_count(config: str, overrides: list[str], nproc_per_node: int) -> None:
    """Before starting processes: the layout must use exactly the processes asked for, and fit the model."""
    from t5forge.config import load_config
    from t5forge.errors import ConfigError
    from t5forge.train.build import check_layout

    run = load_config(config, ["train.output_dir=unused", *overrides])
    p = run.parallel
    if p.dp * p.tp * p.pp != nproc_per_node:
        raise ConfigError(f"parallel.dp x tp x pp = {p.dp} x {p.tp} x {p.pp} = {p.dp * p.tp * p.pp}, but "
                          f"--nproc-per-node={nproc_per_node}; make them equal")
    check_layout(run, nproc_per_node)


def _under_launcher() -> bool:
    import os

    return "LOCAL_RANK" in os.environ


def cmd_train(args: argparse.Namespace) -> int:
    """`train` and `finetune` (the same loop; finetune sets data.task=text_to_text)."""
    command = args.command
    if getattr(args, "dry_run", False):
        return cmd_dry_run(args)
    if getattr(args, "world_size", None) is not None or getattr(args, "rank", None) is not None:
        from t5forge.errors import ConfigError

        raise ConfigError("--world-size and --rank describe a dry run: add --dry-run (or use `t5forge dry-run`); "
                          "a real run takes its ranks from torchrun (--nproc-per-node)")
    if args.nproc_per_node and not _under_launcher():
        task = ["data.task=text_to_text"] if command == "finetune" else []
        _check_process_count(args.config, [*task, *args.overrides], args.nproc_per_node)
        return _relaunch(args.nproc_per_node, [command, args.config, *args.overrides], args.max_restarts)
    from t5forge.config import load_config
    from t5forge.lifecycle import configure_cpu_training, is_main_process
    from t5forge.train.finetune import finetune, load_finetune_config
    from t5forge.train.trainer import train

    run = (load_finetune_config if command == "finetune" else load_config)(args.config, args.overrides)
    configure_cpu_training()
    # A text-to-text run is evaluated by generation, whichever command started it.
    run_dir = (finetune if run.data.task == "text_to_text" else train)(run).run_dir
    # The trainer is gone by now, collected while the interpreter is fully alive: communication handles
    # that FSDP keeps (gloo work objects holding tensors) must not die during interpreter shutdown, where
    # freeing them aborts the process ("terminate called without an active exception").
    import gc

    gc.collect()
    if is_main_process():
        print(f"run directory: {run_dir}")
    return 0


def cmd_dry_run(args: argparse.Namespace) -> int:
    """`dry-run` and `train --dry-run`: one rank's training step at any world size, in this process."""
    from t5forge.config import load_config
    from t5forge.errors import ConfigError
    from t5forge.train.dry_run import dry_run, format_dry_run

    if args.world_size is None:
        raise ConfigError("a dry run needs --world-size N (the number of ranks of the layout, dp x tp x pp)")
    if args.nproc_per_node:
        raise ConfigError("a dry run is one process standing for --world-size ranks: remove --nproc-per-node")
    run = load_config(args.config, args.overrides)
    result = dry_run(run, args.world_size, rank=args.rank or 0, device=args.device)
    print(json.dumps(result, indent=1) if args.json else format_dry_run(result))
    return 0


EXIT_EXCESS_COMMUNICATION = 1


def cmd_comm_audit(args: argparse.Namespace) -> int:
    if args.nproc_per_node and not _under_launcher():
        _check_process_count(args.config, args.overrides, args.nproc_per_node)
        return _relaunch(args.nproc_per_node, ["comm-audit", args.config, *args.overrides,
                                               *(["--json"] if args.json else [])])
    from t5forge.lifecycle import configure_cpu_training, is_main_process
    from t5forge.train.trainer import run_comm_audit

    configure_cpu_training()
    report = run_comm_audit(args.config, args.overrides, echo=(lambda *_: None) if args.json else print)
    if args.json and is_main_process():
        print(json.dumps(report, indent=1))
    return 0 if report["ok"] else EXIT_EXCESS_COMMUNICATION


def _plan_model(model: str):
    """(model config, defaults) of `t5forge plan MODEL`: a preset or an HF directory (no defaults), or a run
    config (its global batch and lengths)."""
    if not Path(model).is_file():
        return _load_config(model), {}
    from t5forge.config import batch_arithmetic, load_config
    from t5forge.train.build import build_model_config, targets_length

    run = load_config(model, ["train.output_dir=unused"])
    batch, _ = batch_arithmetic(run.train.global_batch_size, run.train.micro_batch_size, run.parallel.dp)
    return build_model_config(run), {"global_batch": batch, "inputs_length": run.data.inputs_length,
                                     "targets_length": targets_length(run)}


def cmd_plan(args: argparse.Namespace) -> int:
    from t5forge.data.spans import compute_input_and_target_lengths
    from t5forge.errors import ConfigError
    from t5forge.parallel.planner import (
        Planner,
        Workload,
        format_explanation,
        format_plan,
        make_cluster,
        parse_bandwidth,
        parse_memory,
        plan_dict,
        prediction_dict,
    )

    config, defaults = _plan_model(args.model)
    batch = args.global_batch or defaults.get("global_batch")
    if batch is None:
        raise ConfigError("--global-batch is required (MODEL is a preset or an HF directory, not a run config)")
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    inputs = args.inputs_length or defaults.get("inputs_length", 512)
    targets = args.targets_length or defaults.get("targets_length") or compute_input_and_target_lengths(inputs)[1]
    cluster = make_cluster(args.gpus, args.gpu, args.gpus_per_node,
                           memory=parse_memory(args.gpu_memory) if args.gpu_memory else None,
                           intra_node=parse_bandwidth(args.intra_node_bandwidth) if args.intra_node_bandwidth else None,
                           inter_node=parse_bandwidth(args.inter_node_bandwidth) if args.inter_node_bandwidth else None)
    planner = Planner(config, cluster, Workload(batch, inputs, targets))
    if args.explain:
        prediction = planner.explain(args.explain)
        text = json.dumps(prediction_dict(prediction), indent=1) + "\n" if args.json else \
            format_explanation(planner, prediction)
        print(text, end="")
        return 0
    plan = planner.plan(top=args.top, model=args.model)
    print(json.dumps(plan_dict(plan), indent=1) + "\n" if args.json else format_plan(plan), end="")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from t5forge.train.evaluate import evaluate_run

    result = evaluate_run(args.run_dir, split=args.split, samples=args.samples, checkpoint=args.checkpoint)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['checkpoint']}: {args.split} loss {result['loss']:.4f} perplexity {result['perplexity']:.2f} "
              f"token accuracy {100 * result['accuracy']:.2f}% over {result['samples']} samples")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from t5forge.inference import generate_command

    generate_command(args.model, args.texts, input_path=args.input, input_field=args.input_field, output=args.output,
                     prediction_field=args.prediction_field, tokenizer=args.tokenizer, tp=args.tp, batch_size=args.batch_size,
                     max_input_tokens=args.max_input_tokens, truncate=args.truncate, seed=args.seed,
                     progress=bool(args.input), dtype=args.dtype, compile=args.compile,
                     max_new_tokens=args.max_new_tokens,
                     min_new_tokens=args.min_new_tokens, num_beams=args.num_beams,
                     num_return_sequences=args.num_return_sequences, do_sample=args.do_sample,
                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                     repetition_penalty=args.repetition_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
                     length_penalty=args.length_penalty)
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    """`slurm`: the run's sbatch script (RUN_DIR/slurm/t5forge.sbatch), checked against the layout; --submit."""
    import shlex

    from t5forge.config import load_config
    from t5forge.errors import ConfigError
    from t5forge.slurm import submit, write_script
    from t5forge.train.build import check_output_dir

    for name in ("nodes", "max_restarts", "gpus_per_node"):
        if getattr(args, name) < (1 if name == "nodes" else 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {1 if name == 'nodes' else 0}, "
                              f"got {getattr(args, name)}")
    nproc = args.nproc_per_node or args.gpus_per_node
    if not nproc:
        raise ConfigError("--gpus-per-node 0 (a CPU cluster) needs --nproc-per-node N: the processes per node")
    _check_process_count(args.config, args.overrides, args.nodes * nproc)
    run = load_config(args.config, args.overrides)
    run_dir = Path(run.train.output_dir)
    check_output_dir(run_dir, run.train.overwrite_output_dir)
    command = shlex.join(["t5forge", "slurm", args.config, *args.overrides, "--nodes", str(args.nodes),
                          "--gpus-per-node", str(args.gpus_per_node), "--nproc-per-node", str(nproc)])
    script = write_script(args.config, args.overrides, run_dir, args.nodes, args.gpus_per_node, nproc,
                          time=args.time, partition=args.partition, notice_s=args.signal_notice,
                          max_restarts=args.max_restarts, job_name=args.job_name, command=command)
    print(f"wrote {script} (the job's output goes to {script.parent}/)")
    if args.submit:
        print(f"submitted job {submit(script)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from t5forge.serve.server import serve_command

    serve_command(args.model, host=args.host, port=args.port, tokenizer=args.tokenizer,
                  max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
                  max_input_tokens=args.max_input_tokens, max_new_tokens=args.max_new_tokens_cap,
                  max_beams=args.max_beams, dtype=args.dtype, compile=args.compile, tp=args.tp,
                  api_key=args.api_key, log_level=args.log_level)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from t5forge.report import write_report

    write_report(args.paths, args.output, bench=args.bench, verify_checksums=not args.no_checksums,
                 echo=lambda line: print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout))
    return 0


def cmd_checkpoint_verify(args) -> int:
    from t5forge.errors import CheckpointError
    from t5forge.train.checkpoint import MANIFEST, checkpoint_problems, is_dcp_checkpoint

    root = Path(args.directory)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; pass a checkpoint, a run's checkpoints/ or a run directory")
    found = ([root] if is_dcp_checkpoint(root) or (root / MANIFEST).is_file()
             else sorted([*root.glob("step_*"), *root.glob("checkpoints/step_*")]))
    if not found:
        raise CheckpointError(f"{root} holds no checkpoint (no .metadata, no step_* directories)")
    damaged = 0
    for path in found:
        problems = checkpoint_problems(path)
        damaged += bool(problems)
        print(f"{path}: " + ("ok" if not problems else "DAMAGED: " + "; ".join(problems)))
    print(f"{len(found) - damaged} of {len(found)} checkpoints intact")
    return 1 if damaged else 0


def build_parser() -> argparse.ArgumentParser:
    import t5forge

    parser = argparse.ArgumentParser(
        prog="t5forge", description="Pretrain, fine-tune, evaluate, benchmark and run HuggingFace-compatible T5, "
        "T5 v1.1, mT5, Flan-T5 and UMT5 models on PyTorch, from one CPU to many GPUs. Run `t5forge COMMAND -h` "
        "for a command's options.")
    parser.add_argument("--version", action="version", version=f"t5forge {t5forge.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="size and memory of a preset or an HF model directory")
    info.add_argument("model", metavar="PRESET|DIR")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.set_defaults(func=cmd_info)

    convert = sub.add_parser(
        "convert", help="convert between HF directories and t5forge (DCP) checkpoints",
        description="SOURCE is an HF model directory (config.json + safetensors or pytorch_model.bin, "
                    "single or sharded) or a t5forge DCP checkpoint; OUTPUT must not exist or be empty.")
    convert.add_argument("source", metavar="SOURCE")
    convert.add_argument("output", metavar="OUTPUT")
    convert.add_argument("--to", choices=("hf", "dcp"), default="hf", help="output format (default hf)")
    convert.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep stored dtypes)")
    convert.add_argument("--max-shard-size", default="5GB", help="HF output shard size (default 5GB)")
    convert.set_defaults(func=cmd_convert)

    checkpoint = sub.add_parser("checkpoint", help="inspect checkpoints")
    checkpoint_sub = checkpoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = checkpoint_sub.add_parser(
        "verify", help="check checkpoints against their manifests (files, sizes, SHA-256)",
        description="DIR is a checkpoint (step_* or one written by convert), a run's checkpoints/ directory or "
                    "a run directory: every checkpoint found is checked. Exit 0 when all are intact, 1 otherwise.")
    verify.add_argument("directory", metavar="DIR")
    verify.set_defaults(func=cmd_checkpoint_verify)

    corpus = sub.add_parser("corpus", help="write a built-in text corpus or fine-tuning task")
    corpus.add_argument("name", choices=["python-docs", "python-functions", "python-modules"],
                        help="python-docs: standard-library docstrings + language reference (~2 MB, PSF licence); "
                             "python-functions / python-modules: JSONL tasks, a function docstring's first "
                             "sentence -> the function's name / its top-level standard-library module")
    corpus.add_argument("--output", required=True, metavar="FILE")
    corpus.set_defaults(func=cmd_corpus)

    tokenizer = sub.add_parser("tokenizer", help="train a T5 SentencePiece tokenizer")
    tokenizer_sub = tokenizer.add_subparsers(dest="action", required=True, metavar="ACTION")
    train = tokenizer_sub.add_parser("train", help="unigram SentencePiece with T5's pad/eos/unk ids and 100 sentinels")
    train.add_argument("--input", nargs="+", required=True, metavar="[LANG=]FILE",
                       help="text files, one sentence a line; tag each with its language (en=en.txt de=de.txt) to "
                            "sample the languages by --temperature and see each one's character coverage")
    train.add_argument("--vocab-size", type=int, required=True,
                       help="SentencePiece pieces; the 100 sentinels come on top (T5: 32000 -> 32100 ids)")
    train.add_argument("--output", required=True, metavar="DIR")
    train.add_argument("--character-coverage", type=float, default=1.0,
                       help="1.0 for small alphabets; 0.9995 for many scripts (mT5-style corpora)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--input-sentence-size", type=int, metavar="N",
                       help="sentences sampled from the inputs to train on (default 2,000,000; memory grows with N, "
                            "not with the corpus)")
    train.add_argument("--temperature", type=float, metavar="ALPHA",
                       help="tagged inputs: a language's share of the sample is proportional to its sentences ** "
                            "ALPHA (mT5: 0.3; default 1, in proportion to the text; 0: all alike)")
    train.set_defaults(func=cmd_tokenizer_train)

    pre = sub.add_parser("preprocess", help="tokenize text into a Megatron-compatible indexed dataset",
                         description="Plain text (a blank line separates documents), JSON lines (.jsonl/.json, "
                                     "text under --json-key), either optionally .gz or .zst, or parquet (the "
                                     "--json-key column), read as streams. Writes PREFIX.bin and PREFIX.idx, one "
                                     "sequence per document ending in eos, and PREFIX.json (tokenizer fingerprint, "
                                     "counts). Work goes in shards (PREFIX.shards/): a run started again resumes "
                                     "at the first unfinished one. --merge joins existing datasets instead.")
    pre.add_argument("--input", nargs="+", metavar="PATH_OR_GLOB", help="files, or globs such as 'data/**/*.jsonl.zst'")
    pre.add_argument("--merge", nargs="+", metavar="PREFIX",
                     help="join these datasets, in order, into --output (Megatron's merge_datasets)")
    pre.add_argument("--tokenizer", metavar="DIR")
    pre.add_argument("--output", required=True, metavar="PREFIX")
    pre.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    pre.add_argument("--json-key", default="text", help="the text's key in JSON lines, or its parquet column")
    pre.add_argument("--shard-size", default="1GB", metavar="SIZE",
                     help="text per shard, the unit of resuming (default 1GB; each input file starts a shard)")
    pre.add_argument("--skip-bad-lines", action="store_true",
                     help="skip lines that are not UTF-8 (or not JSON records, or null rows) and count them")
    pre.set_defaults(func=cmd_preprocess)

    def run_command(name: str, func, help: str, description: str, nproc_help: str) -> argparse.ArgumentParser:
        """A command over a run config: CONFIG, key=value overrides, --nproc-per-node."""
        command = sub.add_parser(name, help=help, description=description)
        command.add_argument("config", metavar="CONFIG.yaml")
        command.add_argument("overrides", nargs="*", metavar="key=value")
        command.add_argument("--nproc-per-node", type=int, metavar="N", help=nproc_help)
        command.set_defaults(func=func)
        return command

    train_command = run_command("train", cmd_train, "pretrain a T5 on an indexed dataset",
                "CONFIG is a YAML run config (see configs/); each key=value (dotted, e.g. train.max_steps=100) "
                "overrides it.",
                "start N processes on this machine (torchrun --standalone); for several machines run "
                "`torchrun ... -m t5forge train` on each (see docs/guides/distributed.md)")
    finetune_command = run_command("finetune", cmd_train,
                "fine-tune on a text-to-text task (JSONL input/target lines), scored by generation",
                "As `train`, with data.task=text_to_text: CONFIG names model.path (an HF directory or a t5forge "
                "run), data.train_file (and valid_file), data.inputs_length and targets_length. Writes "
                "RUN_DIR/predictions/, the task metrics in metrics.jsonl and the best model in RUN_DIR/best.",
                "start N processes on this machine")
    for command in (train_command, finetune_command):
        command.add_argument("--max-restarts", type=int, default=0, metavar="N",
                             help="with --nproc-per-node: restart the processes up to N times when one dies; "
                                  "they resume from the newest complete checkpoint (train.resume=auto)")
    dry = run_command(
        "dry-run", cmd_dry_run,
        "one rank's training step of a layout at any world size, in this process: peak memory by category "
        "and every collective against the analytic minimum (nothing allocated on the CPU: fake tensors)",
        "CONFIG and key=value overrides as for `train` (the data is not read: batches of the run's shapes are "
        "made up). The same as `t5forge train CONFIG --dry-run`.", "not for dry runs")

    def dry_run_options(command: argparse.ArgumentParser, flag: bool) -> None:
        if flag:
            command.add_argument("--dry-run", action="store_true",
                                 help="do not train: one rank's step at --world-size ranks, in this process "
                                      "(see `t5forge dry-run`)")
        command.add_argument("--world-size", type=int, metavar="N", help="dry run: ranks of the layout (dp x tp x pp)")
        command.add_argument("--rank", type=int, metavar="R", help="dry run: the rank examined (default 0)")
        command.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                             help="dry run: cpu = fake tensors (nothing allocated); cuda = the rank's real kernels "
                                  "on the one GPU (real peak memory and step time), collectives fake")
        command.add_argument("--json", action="store_true", help="dry run: print the result as JSON")

    dry_run_options(train_command, flag=True)
    dry_run_options(dry, flag=False)
    audit = run_command(
        "comm-audit", cmd_comm_audit,
        "run two training steps of a layout and compare every collective of the second with the layout's "
        "analytic minimum (exit 1 when anything differs)",
        "CONFIG and key=value overrides as for `train` (train.output_dir is optional here); prints, per "
        "collective and mesh dimension, the count and bytes issued beside those required, and the time the "
        "step waited on them.",
        "start N processes on this machine")
    audit.add_argument("--json", action="store_true", help="print the report as JSON (rank 0)")

    plan = sub.add_parser(
        "plan", help="rank the parallel layouts of a model on a cluster by predicted step time",
        description="Enumerates dp/tp/pp, ZeRO stage, sequence parallelism, activation checkpointing, micro-batch "
                    "and pipeline schedule; drops what does not fit in memory; predicts each step (compute at a "
                    "stated share of the GPU's peak, the communication model's bytes over the links, the pipeline "
                    "bubble) and prints the fastest. MODEL is a preset, an HF directory or a run config (YAML: its "
                    "global batch and lengths are the defaults). See docs/guides/planner.md.")
    plan.add_argument("model", metavar="MODEL")
    plan.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs in all")
    plan.add_argument("--gpus-per-node", type=int, metavar="G", help="default: the GPU's reference system (8)")
    plan.add_argument("--gpu", default="A100", help="GPU kind (default A100, the 80 GB SXM4): "
                      "H200, H100, H100-PCIE, A100, A100-40GB, V100, V100-16GB, L40S, L4, T4")
    plan.add_argument("--gpu-memory", metavar="SIZE", help="memory per GPU, e.g. 80GiB (GiB and G: 2^30 bytes, GB: "
                      "10^9); default: the GPU's")
    plan.add_argument("--global-batch", type=int, metavar="B", help="samples per step (required unless MODEL is a "
                      "run config)")
    plan.add_argument("--inputs-length", type=int, metavar="S", help="encoder tokens (default 512)")
    plan.add_argument("--targets-length", type=int, metavar="T",
                      help="decoder tokens (default: span corruption of the inputs, 114 for 512)")
    plan.add_argument("--intra-node-bandwidth", metavar="RATE", help="per GPU and direction, e.g. 300GB/s "
                      "(default: the GPU's NVLink or PCIe)")
    plan.add_argument("--inter-node-bandwidth", metavar="RATE", help="per GPU and direction, e.g. 200Gbps or 25GB/s "
                      "(default: the GPU's reference system)")
    plan.add_argument("--top", type=int, default=5, metavar="K", help="layouts to print (default 5)")
    plan.add_argument("--explain", metavar="LAYOUT", help="the breakdown of one layout, e.g. "
                      "dp2_tp2_pp1_zero2_mb16_acfull (without mb<N>: its fastest micro-batch that fits)")
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON")
    plan.set_defaults(func=cmd_plan)

    evaluation = sub.add_parser("eval", help="validation/test loss, perplexity and token accuracy of a run")
    evaluation.add_argument("run_dir", metavar="RUN_DIR")
    evaluation.add_argument("--split", choices=["valid", "test"], default="valid")
    evaluation.add_argument("--samples", type=int, help="samples to evaluate (default: train.eval_samples)")
    evaluation.add_argument("--checkpoint", help="a checkpoint directory (default: the run's latest)")
    evaluation.add_argument("--json", action="store_true")
    evaluation.set_defaults(func=cmd_eval)

    gen = sub.add_parser("generate", help="generate text with a model (greedy, beam search or sampling)",
                         description="MODEL_OR_RUN_DIR: an HF model directory or a t5forge run directory (its "
                                     "latest checkpoint). Settings follow transformers' generate.")
    gen.add_argument("model", metavar="MODEL_OR_RUN_DIR")
    gen.add_argument("texts", nargs="*", metavar="TEXT", help="inputs (or --input FILE.jsonl)")
    gen.add_argument("--tokenizer", help="tokenizer directory (default: the model's, or the run's)")
    gen.add_argument("--input", metavar="FILE.jsonl", help="one JSON object per line, with --input-field")
    gen.add_argument("--input-field", default="input", help="the field of --input lines to read (default input)")
    gen.add_argument("--output", metavar="FILE.jsonl",
                     help="write each --input line with its prediction added here (not over the input file)")
    gen.add_argument("--prediction-field", default="prediction", metavar="NAME",
                     help="the field that holds the prediction in the lines written (default prediction)")
    gen.add_argument("--batch-size", type=int, default=8)
    gen.add_argument("--max-input-tokens", type=int, default=512, help="longer inputs are refused (or --truncate)")
    gen.add_argument("--truncate", action="store_true", help="cut inputs at --max-input-tokens instead")
    gen.add_argument("--max-new-tokens", type=int, default=20)
    gen.add_argument("--min-new-tokens", type=int, default=0)
    gen.add_argument("--num-beams", type=int, default=1)
    gen.add_argument("--num-return-sequences", type=int, default=1)
    gen.add_argument("--length-penalty", type=float, default=1.0)
    gen.add_argument("--no-repeat-ngram-size", type=int, default=0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, help="sampling seed (default: torch's global generator)")
    gen.add_argument("--tp", type=int, default=1,
                     help="tensor parallel: shard an HF model over N ranks (torchrun --nproc-per-node N)")
    gen.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "int8"], default="fp32",
                     help="inference precision: fp32 (on CPUs with prepacked weights), bf16/fp16 (GPUs), int8 "
                          "(CPUs: dynamic quantization)")
    gen.add_argument("--compile", action="store_true",
                     help="decode with a static cache and a torch.compile'd step (CUDA graphs on GPUs)")
    gen.set_defaults(func=cmd_generate)

    slurm = sub.add_parser(
        "slurm", help="write (and submit) the sbatch script of a run on a Slurm cluster",
        description="Writes RUN_DIR/slurm/t5forge.sbatch: one torchrun agent per node (srun), a c10d rendezvous "
                    "on the job's first node, --requeue, SIGUSR1 --signal-notice seconds before the time limit. "
                    "A stop signal makes the run save and exit 128 + the signal; the script requeues the job "
                    "and the next start resumes. The job's output: RUN_DIR/slurm/JOBNAME-JOBID.out.")
    slurm.add_argument("config", metavar="CONFIG.yaml")
    slurm.add_argument("overrides", nargs="*", metavar="key=value")
    slurm.add_argument("--nodes", type=int, required=True, metavar="N")
    slurm.add_argument("--gpus-per-node", type=int, required=True, metavar="G", help="0 on a CPU cluster")
    slurm.add_argument("--nproc-per-node", type=int, metavar="P", help="processes per node (default: G)")
    slurm.add_argument("--time", help="the job's time limit, as sbatch --time (e.g. 12:00:00)")
    slurm.add_argument("--partition", help="as sbatch --partition")
    slurm.add_argument("--signal-notice", type=int, default=120, metavar="S",
                       help="seconds before the time limit that Slurm sends SIGUSR1 (default 120)")
    slurm.add_argument("--max-restarts", type=int, default=0, metavar="N",
                       help="torchrun's restarts of a node's processes when one dies, within one job start")
    slurm.add_argument("--job-name", default="t5forge")
    slurm.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")
    slurm.set_defaults(func=cmd_slurm)

    srv = sub.add_parser("serve", help="serve a model over HTTP with dynamic batching",
                         description="MODEL_OR_RUN_DIR: an HF model directory (with its tokenizer, or --tokenizer) "
                                     "or a t5forge run directory. POST /v1/generate, GET /health, GET /metrics.")
    srv.add_argument("model", metavar="MODEL_OR_RUN_DIR")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--tokenizer", help="tokenizer directory (default: the model's, or the run's)")
    srv.add_argument("--max-batch-size", type=int, default=32,
                     help="inputs decoded together at most, and texts per request (beam search decodes inputs x "
                          "beams rows)")
    srv.add_argument("--max-wait-ms", type=float, default=10.0,
                     help="when idle, how long a first request waits for others to share its batch")
    srv.add_argument("--max-queue", type=int, default=256, help="requests waiting at most (then 503 + Retry-After)")
    srv.add_argument("--max-input-tokens", type=int, default=512,
                     help="longer inputs get 413 (or are cut with \"truncate\": true)")
    srv.add_argument("--max-new-tokens-cap", type=int, default=512, help="the largest max_new_tokens a request may ask")
    srv.add_argument("--max-beams", type=int, default=8,
                     help="the largest num_beams (and num_return_sequences) a request may ask")
    srv.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "int8"], default="fp32",
                     help="as `generate --dtype`")
    srv.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPUs)")
    srv.add_argument("--tp", type=int, default=1, help="tensor parallel over N ranks under torchrun")
    srv.add_argument("--api-key", help="require Authorization: Bearer KEY (default: $T5FORGE_API_KEY, if set)")
    srv.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    srv.set_defaults(func=cmd_serve)

    from t5forge.bench import SUITES

    report = sub.add_parser(
        "report", help="one self-contained HTML page of a run, of runs compared, or of benchmark results",
        description="Losses against steps and tokens, learning rate, gradient norm, throughput, MFU and memory, "
        "fine-tuning scores and predictions, the communication audit, model, layout, config (and their "
        "differences) and checkpoints with their verification, in one HTML file that needs no network to view.")
    report.add_argument("paths", nargs="*", metavar="RUN_DIR",
                        help="run directories (several: overlaid and compared), or a directory of benchmark results")
    report.add_argument("--output", "-o", default=None,
                        help="the HTML file (default: RUN_DIR/report.html; report.html for several runs)")
    report.add_argument("--bench", action="append", default=[], metavar="FILE.json",
                        help="a benchmark result of `t5forge bench` (repeatable)")
    report.add_argument("--no-checksums", action="store_true",
                        help="check the checkpoints' file sizes only, not their SHA-256 (fast for large ones)")
    report.set_defaults(func=cmd_report)

    bench = sub.add_parser("bench", help="run a benchmark and write its results (JSON + markdown)")
    bench.add_argument("names", nargs="+", metavar="SUITE_OR_NAME",
                       help="benchmark names such as t5v11_nl4_nah4_hs256_ffn1024_FP32_mb4_gb4_seq512_1n1g (grammar: "
                            "src/t5forge/bench/names.py; training throughput, optionally against transformers; "
                            "train.KEY=VALUE arguments set options of the t5forge side, e.g. "
                            "train.fused_loss=false), or one suite: "
                            + "; ".join(f"{name}: {description}" for name, (_, description) in SUITES.items()))
    bench.add_argument("--output-dir", "--output", default="benchmarks")
    bench.add_argument("--baseline", choices=["hf"], default=None,
                       help="named benchmarks: also step transformers' T5 on the same weights and batches")
    bench.add_argument("--steps", type=int, default=5, help="named benchmarks: timed steps after 2 warm-up steps")
    bench.add_argument("--profile", action="store_true",
                       help="named benchmarks: profile one more step (phase and collective shares, Chrome trace)")
    bench.add_argument("--work-dir", default="runs/bench-data", help="corpus, tokenizer and datasets (reused)")
    bench.set_defaults(func=cmd_bench)
    return parser


# Commands whose positional list may continue after options (`generate MODEL --num-beams 4 "text"`,
# `bench NAME --baseline hf train.compile=true`): argparse stops a positional list at the first option.
_TRAILING_POSITIONALS = {"generate": "texts", "bench": "names", "train": "overrides", "finetune": "overrides",
                         "slurm": "overrides",
                         "comm-audit": "overrides", "dry-run": "overrides"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    field = _TRAILING_POSITIONALS.get(args.command)
    if extra and (field is None or any(item.startswith("-") and len(item) > 1 for item in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        setattr(args, field, [*getattr(args, field), *extra])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from t5forge.errors import T5ForgeError
    from t5forge.lifecycle import check_torch_floor, configure_process

    from t5forge.train.preemption import RunStopped

    configure_process()
    try:
        check_torch_floor()
        return args.func(args)
    except RunStopped as stopped:  # not an error: the status tells a wrapper (Slurm's job script) to requeue
        import gc
        import os

        if int(os.environ.get("RANK", "0")) == 0:
            print(f"t5forge {args.command}: {stopped}", file=sys.stderr)
        status = stopped.exit_status
        stopped.__traceback__ = None  # its frames hold the trainer: collected now, as cmd_train does
        del stopped
        gc.collect()
        return status
    except T5ForgeError as e:
        import os

        where = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # one line, always
        print(f"t5forge {args.command}{where}: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
