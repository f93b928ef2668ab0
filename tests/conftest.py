import contextlib
import os
import sys
from pathlib import Path

import pytest

# Tests never reach the HF hub; helpers in tests/ are importable as plain modules.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).parent))


# One corpus, tokenizer and indexed dataset per test process, built from the default corpus.
from t5forge.data.corpus import write_python_docs  # noqa: E402
from t5forge.data.preprocess import preprocess  # noqa: E402
from t5forge.data.tokenizer import train_tokenizer  # noqa: E402


@pytest.fixture
def netns_cluster():
    """NetnsCluster(nodes, rate=None) (t5forge.testing.cluster), entered, and removed after the test; the test
    skips, saying why, where network namespaces cannot be made."""
    from t5forge.testing.cluster import NetnsCluster, unavailable_reason

    if (reason := unavailable_reason()) is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as clusters:
        yield lambda nodes, rate=None: clusters.enter_context(NetnsCluster(nodes, rate))


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "python-docs.txt"
    write_python_docs(path)
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(corpus_file, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer([corpus_file], vocab_size=2000, output=path)
    return path


@pytest.fixture(scope="session")
def dataset_prefix(corpus_file, tokenizer_dir, tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("ds") / "python-docs"
    preprocess([corpus_file], tokenizer_dir, prefix)
    return prefix
