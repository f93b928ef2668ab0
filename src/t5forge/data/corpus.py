"""The default corpus: English prose that ships with every Python (PSF licence), so the demo and the
tests need no download. Standard-library docstrings plus the language reference in `pydoc_data.topics`,
one document per docstring or topic, written as plain text with a blank line between documents."""

from __future__ import annotations

import ast
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from t5forge.errors import T5ForgeError
from t5forge.fileio import write_text_atomic

# Packages whose docstrings are test scaffolding or vendored code rather than documentation.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
              "turtledemo", "ensurepip"}
_MIN_WORDS = 8


def _clean(text: str) -> str:
    """One document: paragraphs kept on their own lines, no blank lines inside (they separate documents)."""
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return "\n".join(line for line in lines if line.strip())


def _stdlib_docstrings() -> Iterator[str]:
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
