"""Where the text comes from: the user's files, or the embedded default corpus.

A ``Corpus`` yields its text as ``(document_index, chunk)`` pairs: the chunks of one
document are consecutive and split at line ends, so a large file never has to sit in
memory whole and tokenizing chunk by chunk gives the same pieces as tokenizing the
document at once (a newline is always a piece boundary for our tokenizers).

Document boundaries:
- ``*.jsonl``: one document per line, the text under the key ``"text"`` (Megatron's format);
- any other file: plain UTF-8 text, one document per file.

The embedded default (``StdlibCorpus``) is the source of Python's standard library,
which every machine that runs this engine already has: no download, deterministic order,
capped in size so that training a tokenizer on it takes seconds.
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import sysconfig
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from engine.data.errors import DataError
from engine.validate import check_int

__all__ = ["Corpus", "FileCorpus", "StdlibCorpus", "check_train_files", "DEFAULT_EMBEDDED_MAX_BYTES"]

# 4 MB of stdlib source: ~1.3M tokens; BPE training on it takes a few seconds on one core.
DEFAULT_EMBEDDED_MAX_BYTES = 4 * 1024 * 1024
# Plain-text documents are read in chunks of about this many characters (split at a line end).
_CHUNK_CHARS = 1 << 20
# Folders of the standard library that are skipped: third-party packages differ between
# machines; the test suites hold deliberately odd encodings and are most of the bytes.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


class Corpus(abc.ABC):
    """A sequence of documents, read lazily."""

    @abc.abstractmethod
    def fingerprint(self) -> Dict[str, Any]:
        """A JSON-serialisable description that changes whenever the text may have changed."""

    @abc.abstractmethod
    def chunks(self) -> Iterator[Tuple[int, str]]:
        """Yield ``(document_index, text)``; indices start at 0 and increase by one."""

    @abc.abstractmethod
    def describe(self) -> str:
        """A short human-readable name for log lines and error messages."""


def check_train_files(train_files: Any) -> List[str]:
    """Validate ``data.train_files`` and return the absolute paths.

    Each entry must be an existing, readable, non-empty regular file.
    """
    if isinstance(train_files, (str, bytes)):
        raise DataError(f"data.train_files must be a list of paths, got the string {train_files!r}: "
                        f"write [{json.dumps(str(train_files))}]")
    if not isinstance(train_files, (list, tuple)):
        raise DataError(f"data.train_files must be a list of file paths or null, got "
                        f"{type(train_files).__name__}")
    if not train_files:
        raise DataError("data.train_files is an empty list: list at least one text file, "
                        "or set it to null to use the embedded default corpus")
    paths = []
    for i, raw in enumerate(train_files):
        if not isinstance(raw, str) or not raw:
            raise DataError(f"data.train_files[{i}] must be a non-empty path string, got {raw!r}")
        path = os.path.abspath(os.path.expanduser(raw))
        where = f"data.train_files[{i}] = {raw!r}" + ("" if path == raw else f" (resolved to {path})")
        if not os.path.exists(path):
            raise DataError(f"{where} does not exist: fix the path or remove the entry")
        if os.path.isdir(path):
            raise DataError(f"{where} is a directory; data.train_files takes files: "
                            f"list the files inside it instead")
        if not os.path.isfile(path):
            raise DataError(f"{where} is not a regular file: give a text or .jsonl file")
        try:
            with open(path, "rb") as f:
                first = f.read(1)
        except OSError as e:
            raise DataError(f"{where} cannot be read ({e.strerror}): fix its permissions "
                            "or remove the entry") from None
        if not first:
            raise DataError(f"{where} is empty: put text in it or remove the entry")
        paths.append(path)
    return paths


def _read_lines(path: str) -> Iterator[Tuple[int, str]]:
    """Yield ``(line_number, line)`` (1-based, line ends kept); clear errors on bad bytes."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror}): fix its permissions or remove it "
                        "from data.train_files") from None
    with f:
        # Binary lines decoded one at a time, so a bad byte is reported at its exact line.
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {lineno}, byte {e.start} is not valid UTF-8 "
                                f"({e.reason}); convert the file to UTF-8 or remove it from "
                                "data.train_files") from None
            yield lineno, line


def _jsonl_documents(path: str) -> Iterator[str]:
    for lineno, line in _read_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno} is not valid JSON ({e.msg}); a .jsonl file holds one "
                            'JSON object per line such as {"text": "..."}') from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{lineno} has no string field "text"; each line of a .jsonl '
                            'file must be an object such as {"text": "..."}')
        if record["text"]:
            yield record["text"]


def _text_chunks(path: str) -> Iterator[str]:
    buf: List[str] = []
    size = 0
    for _, line in _read_lines(path):
        buf.append(line)
        size += len(line)
        if size >= _CHUNK_CHARS:
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)


class FileCorpus(Corpus):
    """The files of ``data.train_files`` (validated on construction)."""

    def __init__(self, train_files: Sequence[str]) -> None:
        self.paths = check_train_files(train_files)

    def fingerprint(self) -> Dict[str, Any]:
        # Path, size and modification time: hashing the content of a large corpus on every
        # start would cost minutes; any ordinary edit changes size or mtime.
        files = []
        for p in self.paths:
            st = os.stat(p)
            files.append([p, st.st_size, st.st_mtime_ns])
        return {"kind": "files", "files": files}

    def chunks(self) -> Iterator[Tuple[int, str]]:
        doc = 0
        for path in self.paths:
            if path.endswith(".jsonl"):
                for text in _jsonl_documents(path):
                    yield doc, text
                    doc += 1
            else:
                for chunk in _text_chunks(path):
                    yield doc, chunk
                doc += 1

    def describe(self) -> str:
        return f"{len(self.paths)} file(s) from data.train_files"


def _stdlib_files(root: str) -> List[str]:
    out: List[str] = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        out.extend(os.path.join(d, f) for f in sorted(files) if f.endswith(".py"))
    return out


class StdlibCorpus(Corpus):
    """The embedded default: Python standard-library sources, one document per module file.

    Files are taken in sorted path order while they fit under ``max_bytes``; files that are
    not valid UTF-8 are skipped. The text is held in memory (a few MB).
    """

    def __init__(self, max_bytes: int = DEFAULT_EMBEDDED_MAX_BYTES, root: Optional[str] = None) -> None:
        check_int("the embedded corpus size cap (bytes)", max_bytes, minimum=1, error=DataError)
        self.root = root or sysconfig.get_paths()["stdlib"]
        self.max_bytes = max_bytes
        self.documents: List[str] = []
        total = 0
        digest = hashlib.sha256()
        for path in _stdlib_files(self.root) if os.path.isdir(self.root) else []:
            size = os.path.getsize(path)
            if size == 0 or total + size > max_bytes:
                continue
            try:
                with open(path, encoding="utf-8", newline="") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            self.documents.append(text)
            total += size
            digest.update(os.path.relpath(path, self.root).encode() + b"\0" + text.encode() + b"\0")
        if not self.documents:
            raise DataError(f"no Python standard-library sources of at most {max_bytes} bytes found "
                            f"under {self.root} for the embedded default corpus; set "
                            "data.train_files to your own text files")
        self.num_bytes = total
        self._sha256 = digest.hexdigest()

    def fingerprint(self) -> Dict[str, Any]:
        return {"kind": "stdlib", "sha256": self._sha256, "max_bytes": self.max_bytes}

    def chunks(self) -> Iterator[Tuple[int, str]]:
        yield from enumerate(self.documents)

    def describe(self) -> str:
        return (f"embedded default corpus ({len(self.documents)} Python standard-library files, "
                f"{self.num_bytes / 1e6:.1f} MB)")
