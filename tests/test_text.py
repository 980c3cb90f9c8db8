"""The standard-library corpus and the byte-level BPE trained on it."""

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from lowrank_jax.errors import ConfigError  # noqa: E402
from lowrank_jax.text import encode_texts, stdlib_corpus, token_windows, train_bpe  # noqa: E402


def test_corpus_is_deterministic_and_split_by_path():
    a, b = stdlib_corpus(), stdlib_corpus()
    assert a == b and a.train and a.held_out
    assert not set(a.train) & set(a.held_out)
    assert list(a.train) == sorted(a.train)
    assert not any(p.startswith("test/") for p in a.train + a.held_out)
    with_tests = stdlib_corpus(with_tests=True)
    assert any(p.startswith("test/") for p in with_tests.train + with_tests.held_out)
    # a file's side depends on its path only
    assert set(a.held_out) <= set(with_tests.held_out)
    assert a.info()["file_list_sha256"] != with_tests.info()["file_list_sha256"]
    assert 0.05 < len(a.held_out) / (len(a.train) + len(a.held_out)) < 0.15


def test_bpe_round_trips_text_and_windows():
    corpus = stdlib_corpus()
    texts = corpus.read("train", max_bytes=200_000)
    tok = train_bpe(texts, 400)
    assert tok.get_vocab_size() == 400
    sample = corpus.read("held_out", max_bytes=3000)[0][:500]
    assert tok.decode(tok.encode(sample).ids) == sample
    stream = encode_texts(tok, texts[:3])
    assert stream.dtype == np.int32 and np.count_nonzero(stream == 0) == 3
    w = token_windows(stream, 16)
    np.testing.assert_array_equal(w.reshape(-1), stream[:w.size])
    with pytest.raises(ConfigError, match="vocab_size must be an int >= 257"):
        train_bpe(texts, 100)
