"""The default corpus: English prose that ships with every Python (PSF licence), so the demo and the
tests need no download. Standard-library docstrings plus the language reference in `pydoc_data.topics`,
one document per docstring or topic, written as plain text with a blank line between documents."""

from __future__ import annotations

import ast
import os
import re
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from t5forge.errors import T5ForgeError
from t5forge.fileio import write_text_atomic

# Packages whose docstrings are test scaffolding or vendored code rather than documentation.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
              "turtledemo", "ensurepip"}
_MIN_WORDS = 8
MIN_MODULE_EXAMPLES = 100


def _clean(text: str) -> str:
    """One document: paragraphs kept on their own lines, no blank lines inside (they separate documents)."""
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return "\n".join(line for line in lines if line.strip())


def _stdlib_documented() -> Iterator[tuple[str, ast.AST, str]]:
    """(top-level module, module/class/function node, its docstring) of the standard library, in a fixed
    order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            try:
                tree = ast.parse(Path(dirpath, filename).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a few stdlib files are deliberately invalid (bad-syntax examples)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield Path(dirpath, filename).relative_to(root).parts[0].removesuffix(".py"), node, doc


def _stdlib_docstrings() -> Iterator[str]:
    for _, _, doc in _stdlib_documented():
        yield doc


def _language_reference() -> Iterator[str]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def python_docs_documents() -> list[str]:
    """Distinct documents of at least a sentence, in a fixed order (the stdlib walk is sorted)."""
    seen, documents = set(), []
    for text in (*_stdlib_docstrings(), *_language_reference()):
        doc = _clean(text)
        if len(re.findall(r"[A-Za-z]+", doc)) < _MIN_WORDS or doc in seen:
            continue
        seen.add(doc)
        documents.append(doc)
    if not documents:
        raise T5ForgeError("found no standard-library docstrings; is this a full Python installation?")
    return documents


def write_python_docs(output: str | os.PathLike) -> tuple[int, int]:
    """Write the corpus; returns (documents, bytes)."""
    documents = python_docs_documents()
    text = "\n\n".join(documents) + "\n"
    write_text_atomic(output, text)
    return len(documents), len(text.encode("utf-8"))


def python_docstring_task(target: str = "function", min_words: int = 4) -> list[dict[str, str]]:
    """A text-to-text task from the same docstrings: {"input": the first sentence of a public function's
    docstring, "target": the function's name (target="function"), e.g. "Return the number of items in the
    queue." -> "qsize", or the top-level standard-library module it belongs to (target="module"), e.g. ->
    "asyncio"}. A sentence documenting several functions is kept once (its first function), so that every
    input has one answer; the pairs are shuffled with a fixed seed, so that any contiguous split is a
    random one. Modules with fewer than MIN_MODULE_EXAMPLES such functions are left out."""
    import random

    if target not in ("function", "module"):
        raise ValueError(f"target must be 'function' or 'module', got {target!r}")
    seen, pairs = set(), []
    for module, node, doc in _stdlib_documented():
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        paragraph = " ".join(doc.strip().split("\n\n")[0].split())
        sentence = re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph)[0]  # not at "i.e. the"
        if len(re.findall(r"[A-Za-z]+", sentence)) < min_words or sentence in seen:
            continue
        seen.add(sentence)
        pairs.append({"input": sentence, "target": node.name if target == "function" else module})
    if target == "module":  # the modules with enough functions to learn from
        counts = Counter(pair["target"] for pair in pairs)
        pairs = [pair for pair in pairs if counts[pair["target"]] >= MIN_MODULE_EXAMPLES]
    random.Random(0).shuffle(pairs)
    return pairs


def write_docstring_task(output: str | os.PathLike, target: str) -> tuple[int, int]:
    """Write the task as JSONL; returns (examples, bytes)."""
    import json

    pairs = python_docstring_task(target)
    text = "".join(json.dumps(pair) + "\n" for pair in pairs)
    write_text_atomic(output, text)
    return len(pairs), len(text.encode("utf-8"))
