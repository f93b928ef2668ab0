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


# A multilingual demo corpus from the message catalogues (gettext .mo files) of packages every Debian system
# has (Essential: yes), so the demo needs no download either. Each language's text is the translations of the
# packages' messages; English is their original messages (the msgids). The text is not part of t5forge: it is
# read from the machine, and what is written keeps the licence of the package it came from, as
# /usr/share/doc/PACKAGE/copyright states it (their translations are "distributed under the same license as
# the PACKAGE package").
MESSAGE_CATALOGS = {  # gettext domain: (Debian package, licence)
    "coreutils": ("coreutils", "GPL-3+"), "bash": ("bash", "GPL-3+"), "dpkg": ("dpkg", "GPL-2+"),
    "tar": ("tar", "GPL-3+"), "grep": ("grep", "GPL-3+"), "sed": ("sed", "GPL-3+"),
    "diffutils": ("diffutils", "GPL-3+"),
}
DEMO_LANGUAGES = ("en", "de", "fr", "es", "ru", "ja", "zh_CN")
LOCALE_DIR = Path("/usr/share/locale")
# English is the msgids of these languages' catalogues (the same messages, whichever are installed).
_ENGLISH_FROM = ("de", "fr", "es", "ru", "ja")
_MO_MAGIC = 0x950412DE


def read_mo(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(msgid, msgstr) of a compiled gettext catalogue, the header entry left out, decoded with the
    catalogue's charset. Plural forms and contexts stay as gettext stores them (NUL- and EOT-separated)."""
    import struct

    data = Path(path).read_bytes()
    for order in ("<", ">"):
        if len(data) >= 20 and struct.unpack(order + "I", data[:4])[0] == _MO_MAGIC:
            break
    else:
        raise T5ForgeError(f"{path} is not a gettext .mo catalogue")
    count, originals, translations = struct.unpack(order + "3I", data[8:20])
    raw = []
    for i in range(count):
        (olen, ooff), (tlen, toff) = (struct.unpack(order + "2I", data[table + 8 * i:table + 8 * i + 8])
                                      for table in (originals, translations))
        raw.append((data[ooff:ooff + olen], data[toff:toff + tlen]))
    header = next((msgstr for msgid, msgstr in raw if msgid == b""), b"").decode("ascii", "replace")
    charset = re.search(r"charset=([\w.-]+)", header)
    encoding = charset.group(1) if charset and charset.group(1).upper() != "CHARSET" else "utf-8"
    return [(msgid.decode(encoding, "replace"), msgstr.decode(encoding, "replace"))
            for msgid, msgstr in raw if msgid]


def _catalogue(locale_dir: Path, language: str, domain: str) -> Path | None:
    path = locale_dir / language / "LC_MESSAGES" / f"{domain}.mo"
    return path if path.is_file() else None


def _messages(language: str, locale_dir: Path) -> tuple[list[str], list[Path]]:
    """The distinct texts of `language` (msgstrs; for en the msgids), in a fixed order, and the files read."""
    seen, texts, files = set(), [], []
    for domain in MESSAGE_CATALOGS:
        for source in (_ENGLISH_FROM if language == "en" else (language,)):
            path = _catalogue(locale_dir, source, domain)
            if path is None:
                continue
            files.append(path)
            for msgid, msgstr in sorted(read_mo(path)):
                text = msgid.split("\x04")[-1] if language == "en" else msgstr  # without its context
                for form in text.split("\x00"):  # singular and plural forms
                    form = _clean(form)
                    if form and form not in seen:
                        seen.add(form)
                        texts.append(form)
    return texts, files


def write_multilingual_corpus(output_dir: str | os.PathLike, languages: tuple[str, ...] = DEMO_LANGUAGES,
                              max_bytes: int = 256 * 1024, document_bytes: int = 1024,
                              locale_dir: str | os.PathLike = LOCALE_DIR) -> dict[str, tuple[int, int]]:
    """Write OUTPUT_DIR/LANGUAGE.txt for each language with installed catalogues (documents of consecutive
    messages, each of about `document_bytes` of UTF-8, a blank line between them, up to about `max_bytes`
    per language) and OUTPUT_DIR/SOURCES.txt, the files read with their packages and licences. The same
    installed files give the same bytes. Returns {language: (documents, bytes)}; a language without
    catalogues is left out."""
    output_dir, locale_dir = Path(output_dir), Path(locale_dir)
    written, sources = {}, []
    for language in languages:
        texts, files = _messages(language, locale_dir)
        documents, document, document_size, size = [], [], 0, 0
        for message in texts:
            if size >= max_bytes:
                break
            document.append(message)
            document_size += len(message.encode("utf-8")) + 1
            if document_size >= document_bytes:
                documents.append("\n".join(document))
                size += document_size + 1
                document, document_size = [], 0
        if document and size < max_bytes:
            documents.append("\n".join(document))
        if not documents:
            continue
        text = "\n\n".join(documents) + "\n"
        write_text_atomic(output_dir / f"{language}.txt", text)
        written[language] = (len(documents), len(text.encode("utf-8")))
        for path in files:
            package, licence = MESSAGE_CATALOGS[path.stem]
            sources.append(f"{language}.txt  {path}  Debian package {package}, {licence} "
                           f"(/usr/share/doc/{package}/copyright)")
    if not written:
        raise T5ForgeError(f"found no message catalogues of {', '.join(MESSAGE_CATALOGS)} for "
                           f"{', '.join(languages)} under {locale_dir}; install the packages' translations "
                           "(Docker images often strip /usr/share/locale)")
    write_text_atomic(output_dir / "SOURCES.txt", "Text read from gettext catalogues; each file keeps the licence "
                      "of its package.\n" + "\n".join(sources) + "\n")
    return written
