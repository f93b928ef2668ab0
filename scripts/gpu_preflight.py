"""What scripts/gpu_check.sh imports, and where each piece comes from on the lent GPU machine (no network).

The one table of it: gpu_check.sh runs this file first (standard library only, under a second), so a missing
package costs one line instead of a traceback minutes into the run; scripts/gpu_deps.sh asks it for the
pip requirements to bring (`--requirements`); the test suite's emulation of the GPU image
(tests/gpu_emulation/sitecustomize.py) hides exactly the modules listed under BROUGHT and OPTIONAL.

    python scripts/gpu_preflight.py                        # exit 2 and one line when something is missing
    python scripts/gpu_preflight.py --requirements [--matplotlib] [--source-only]"""

from __future__ import annotations

import importlib
import importlib.util
import sys

# On the GPU image already (torch 2.11 + CUDA, transformers 5.17): looked up, not brought.
IMAGE = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "yaml", "rich", "regex", "tqdm")

# The package the check imports -> the pip requirements that bring it together with the dependencies the
# image lacks (pinned to the versions the test suite runs; installed with --no-deps, so listed in full).
BROUGHT = {
    # omegaconf 2.4 needs PyYAML only (2.3 needed antlr4-python3-runtime 4.9.*, an sdist).
    "omegaconf": ["omegaconf==2.4.0"],
    "sentencepiece": ["sentencepiece==0.2.3"],  # data preparation trains a tokenizer first
    "google.protobuf": ["protobuf==7.36.2"],  # reads a SentencePiece model into an HF tokenizer
    # Fine-tuning's evaluation by generation scores ROUGE-L and BLEU (train/task_metrics.py).
    "rouge_score": ["rouge-score==0.1.2", "nltk==3.10.4", "absl-py==2.5.1", "six==1.17.0",
                                 "click==8.5.1", "joblib==1.6.0"],
    "sacrebleu": ["sacrebleu==2.6.0", "portalocker==4.4.2", "tabulate==0.10.0", "colorama==0.4.6", "lxml==6.2.0"],
}
# Only the loss-curve and benchmark plots need it; they are skipped with one line without it.
OPTIONAL = {
    "matplotlib": ["matplotlib==3.11.2", "contourpy", "cycler", "fonttools", "kiwisolver", "pyparsing",
                   "python-dateutil", "pillow"],
}
# What the pre-flight imports to prove a package whole (its own dependencies included).
PROBES = {"rouge_score": "rouge_score.rouge_scorer"}
# Published as source only: gpu_deps.sh builds their (pure-Python) wheels locally.
SOURCE_ONLY = ("rouge-score",)


def missing(modules, load: bool) -> list[str]:
    """The modules that cannot be imported (`load`) or found (else: importing torch alone takes seconds)."""
    absent = []
    for name in modules:
        try:
            found = importlib.import_module(name) if load else importlib.util.find_spec(name)
        except Exception:  # ImportError, or a broken package raising anything while it loads
            found = None
        if found is None:
            absent.append(name)
    return absent


def main(argv: list[str]) -> int:
    if "--requirements" in argv:
        tables = [BROUGHT, *([OPTIONAL] if "--matplotlib" in argv else [])]
        requirements = [r for table in tables for rs in table.values() for r in rs]
        source = "--source-only" in argv
        print("\n".join(r for r in requirements if (r.split("==")[0] in SOURCE_ONLY) == source))
        return 0
    lacking = missing(IMAGE, load=False) + missing([PROBES.get(p, p) for p in BROUGHT], load=True)
    if lacking:
        print(f"gpu_check: missing Python modules: {', '.join(lacking)}. Run scripts/gpu_deps.sh on a machine with "
              f"the package index (it fills .gpu-deps for the GPU image's Python; set T5FORGE_GPU_DEPS for another "
              f"folder) and bring that folder along; {', '.join(IMAGE)} must be on the image itself.", file=sys.stderr)
        return 2
    if missing(OPTIONAL, load=False):
        print("gpu_check: matplotlib is missing: the loss-curve and benchmark plots are skipped "
              "(scripts/gpu_deps.sh --matplotlib brings it)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
