"""Real text on every machine, offline: the Python standard library's own source.

The standard library's ``.py`` files are English (docstrings, comments) and code, present
wherever Python is. :func:`stdlib_corpus` lists them deterministically (sorted relative paths
under ``sysconfig``'s ``stdlib`` directory, without ``site-packages``; the ``test`` packages
left out unless asked), splits them into training and held-out files by a hash of each path (so
the split does not depend on the listing order or on which other files exist), and records what
makes a run reproducible: the Python version and a SHA-256 of the file list.
:func:`train_bpe` trains a byte-level BPE tokenizer on the training files with the
``tokenizers`` package, and :func:`token_windows` cuts the token stream into fixed-length
language-modelling windows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig

import numpy as np

from lowrank_jax.errors import ConfigError, DataError, MissingDependencyError

SKIP_DIRS = ("site-packages", "__pycache__", "idlelib", "turtledemo", "lib2to3", "ensurepip")
TEST_DIRS = ("test", "tests", "idle_test")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A deterministic split of the standard library's source files.

    Attributes:
      root: the standard library directory.
      train, held_out: relative paths of the files of each part, sorted.
      python: the Python version whose library this is.
      file_list_sha256: SHA-256 of the sorted relative paths (one per line) of both parts.
      with_tests: whether the ``test`` packages are included.
    """

    root: str
    train: tuple[str, ...]
    held_out: tuple[str, ...]
    python: str
    file_list_sha256: str
    with_tests: bool

    def read(self, part: str, max_bytes: int | None = None) -> list[str]:
        """The texts of ``part`` (``'train'`` or ``'held_out'``), up to ``max_bytes`` in all
        (whole files, in order)."""
        if part not in ("train", "held_out"):
            raise ConfigError(f"Corpus.read: part must be 'train' or 'held_out', got {part!r}",
                              where="part", expected=("train", "held_out"), actual=part)
        out, total = [], 0
        for rel in getattr(self, part):
            with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
                text = f.read()
            if max_bytes is not None and total + len(text) > max_bytes and out:
                break
            out.append(text)
            total += len(text)
        return out

    def info(self) -> dict:
        """What a report records: Python version, file counts, the file-list hash."""
        return {"python": self.python, "root": self.root, "with_tests": self.with_tests,
                "train_files": len(self.train), "held_out_files": len(self.held_out),
                "file_list_sha256": self.file_list_sha256}


def _held_out(rel: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h / 2.0 ** 64 < fraction


def stdlib_corpus(*, held_out_fraction: float = 0.1, with_tests: bool = False,
                  root: str | None = None) -> Corpus:
    """The standard library's ``.py`` files, split into training and held-out files.

    Args:
      held_out_fraction: the share of files held out (chosen by a hash of each relative path).
      with_tests: include the ``test`` packages (default: left out).
      root: the directory to list (default ``sysconfig.get_paths()['stdlib']``).

    Returns:
      The :class:`Corpus`.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ConfigError(f"stdlib_corpus: held_out_fraction must be in (0, 1), got "
                          f"{held_out_fraction!r}", where="held_out_fraction",
                          expected="(0, 1)", actual=held_out_fraction)
    root = os.path.realpath(root or sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        skip = SKIP_DIRS + (() if with_tests else TEST_DIRS)
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                files.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
    files.sort()
    if not files:
        raise DataError(f"stdlib_corpus: no .py files under {root}", where=root)
    digest = hashlib.sha256("\n".join(files).encode()).hexdigest()
    held = tuple(f for f in files if _held_out(f, held_out_fraction))
    train = tuple(f for f in files if not _held_out(f, held_out_fraction))
    return Corpus(root=root, train=train, held_out=held, python=platform.python_version(),
                  file_list_sha256=digest, with_tests=with_tests)


def train_bpe(texts: list[str], vocab_size: int, *, min_frequency: int = 2):
    """A byte-level BPE tokenizer (``tokenizers``) trained on ``texts``; every byte is in the
    vocabulary, so any text encodes. Token ``0`` is ``<|endoftext|>``, used as document
    separator, end-of-sequence and padding."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:  # pragma: no cover
        raise MissingDependencyError("train_bpe needs the tokenizers package "
                                     "(pip install tokenizers)") from None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise ConfigError(f"train_bpe: vocab_size must be an int >= 257 (the bytes and "
                          f"<|endoftext|>), got {vocab_size!r}", where="vocab_size",
                          expected=">= 257", actual=vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_texts(tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream of ``texts``, each followed by token 0 (``<|endoftext|>``)."""
    out = []
    for enc in tokenizer.encode_batch(texts):
        out.extend(enc.ids)
        out.append(0)
    return np.asarray(out, np.int32)


def token_windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows ``[n, seq_len]`` of a token stream (the tail is dropped)."""
    n = len(stream) // seq_len
    if n < 1:
        raise DataError(f"token_windows: {len(stream)} tokens make no window of {seq_len}",
                        where="seq_len", expected=f"<= {len(stream)}", actual=seq_len)
    return np.asarray(stream[:n * seq_len], np.int32).reshape(n, seq_len)


__all__ = ["Corpus", "SKIP_DIRS", "TEST_DIRS", "encode_texts", "stdlib_corpus", "token_windows",
           "train_bpe"]
