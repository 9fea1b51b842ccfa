"""neox.data: corpus sources and their checksums, the offline fallback, tokenizers, token windows,
and the distributed sampler's coverage, determinism and exact resume.

Nothing here touches the network: downloads are exercised with file:// URLs.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from neox.data import (
    TINY_SHAKESPEARE_SHA256, Corpus, DataError, TokenDataset, WindowSampler, batch, check_vocab,
    default_data_dir, eval_batches, load_corpus, load_tokenizer, tokenizer_rows,
)

from tests.support.neox_testing import NEOX_TOKENIZER, SHAKESPEARE, SHARED_DATA_DIR as DATA_DIR
from tests.support.neox_testing import with_shared_data as needs_shared_data


class Log:
    """Collects log lines so tests can check what was said."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def has(self, text: str) -> bool:
        return any(text in line for line in self.lines)


def missing_url(tmp_path: Path) -> str:
    """A URL whose fetch fails at once, like a machine without network."""
    return (tmp_path / "no-such-file").as_uri()


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------

def test_default_data_dir_is_beside_the_repository():
    repo_root = Path(__file__).resolve().parents[2]
    assert default_data_dir() == repo_root.parent / "shared" / "data"


@needs_shared_data
def test_shared_copy_is_the_known_file():
    assert hashlib.sha256(SHAKESPEARE.read_bytes()).hexdigest() == TINY_SHAKESPEARE_SHA256


@needs_shared_data
def test_tiny_shakespeare_from_data_dir_then_cache(tmp_path):
    cache = tmp_path / "cache"
    log = Log()
    corpus = load_corpus(None, cache_dir=cache, data_dir=DATA_DIR, url=None, log=log)
    assert corpus.name == "tiny_shakespeare"
    assert len(corpus.text) == 1_115_394  # ASCII: characters == bytes
    assert corpus.text.startswith("First Citizen:")
    assert corpus.source == str(SHAKESPEARE)
    cached = cache / "tiny_shakespeare.txt"
    assert cached.read_bytes() == SHAKESPEARE.read_bytes()

    # Second load: from the cache, even with no data directory.
    log = Log()
    again = load_corpus(None, cache_dir=cache, data_dir=None, url=None, log=log)
    assert again.text == corpus.text and again.source == str(cached)
    assert log.has("from cache")


@needs_shared_data
def test_cache_checksum_mismatch_is_detected_and_repaired(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cached = cache / "tiny_shakespeare.txt"
    cached.write_text("First Citizen:\nthis is not the real file\n")
    log = Log()
    corpus = load_corpus(None, cache_dir=cache, data_dir=DATA_DIR, url=None, log=log)
    assert log.has("wrong checksum")
    assert corpus.name == "tiny_shakespeare" and len(corpus.text) == 1_115_394
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == TINY_SHAKESPEARE_SHA256


@needs_shared_data
def test_download_verifies_checksum_and_caches(tmp_path):
    # A file:// URL runs the whole download path (fetch, checksum, atomic rename) offline.
    cache = tmp_path / "cache"
    log = Log()
    corpus = load_corpus(None, cache_dir=cache, data_dir=tmp_path / "empty",
                         url=SHAKESPEARE.as_uri(), log=log)
    assert corpus.name == "tiny_shakespeare" and log.has("downloaded")
    assert (cache / "tiny_shakespeare.txt").read_bytes() == SHAKESPEARE.read_bytes()
    assert [p.name for p in cache.iterdir()] == ["tiny_shakespeare.txt"]  # no temp files left


def test_wrong_download_is_rejected(tmp_path):
    impostor = tmp_path / "input.txt"
    impostor.write_text("not shakespeare\n")
    cache = tmp_path / "cache"
    log = Log()
    corpus = load_corpus(None, cache_dir=cache, data_dir=None, url=impostor.as_uri(), log=log)
    assert log.has("checksum mismatch")
    assert corpus.name == "pydoc_topics"
    assert not (cache / "tiny_shakespeare.txt").exists()


def test_offline_fallback_uses_pydoc_topics_and_says_so(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    log = Log()
    corpus = load_corpus(None, cache_dir=tmp_path / "cache", data_dir=empty,
                         url=missing_url(tmp_path), log=log)
    from pydoc_data.topics import topics
    assert corpus.name == "pydoc_topics"
    assert topics["for"] in corpus.text
    assert len(corpus.text) > 100_000  # enough text for the default run's windows
    assert log.has("could not download") and log.has("FALLING BACK") and log.has("pydoc_data")


def test_data_file_is_read(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("héllo wörld\n" * 10, encoding="utf-8")
    corpus = load_corpus(path, cache_dir=tmp_path / "cache", data_dir=None, log=Log())
    assert corpus.text == "héllo wörld\n" * 10
    assert corpus.name == "notes.txt" and corpus.source == str(path)


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("directory", "is a directory"),
    ("latin1", "is not UTF-8"),
    ("empty", "is empty"),
])
def test_data_file_errors_name_the_file(tmp_path, case, message):
    path = tmp_path / "corpus.txt"
    if case == "directory":
        path.mkdir()
    elif case == "latin1":
        path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    elif case == "empty":
        path.write_text(" \n\n")
    with pytest.raises(DataError, match=message) as info:
        load_corpus(path, cache_dir=tmp_path / "cache", data_dir=None, log=Log())
    assert str(path) in str(info.value)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

SAMPLE = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
          "All:\nSpeak, speak.  Tabs\tand  double  spaces, unicode: naïve café — ok.\n")


@needs_shared_data
def test_neox_tokenizer_loads_and_round_trips(tmp_path):
    tokenizer = load_tokenizer(NEOX_TOKENIZER, corpus=Corpus("", "x", "x"), cache_dir=tmp_path,
                               log=Log())
    ids = tokenizer.encode(SAMPLE, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == SAMPLE
    # GPT-NeoX-20B's tokens start at <|endoftext|> = 0; the shared file carries a few extra
    # added tokens after the 50277 of the original, all within the model's 50432 rows.
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    assert 50277 <= tokenizer_rows(tokenizer) <= 50432
    check_vocab(tokenizer, 50432)

    # A checkpoint directory holding tokenizer.json works the same.
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    shutil.copyfile(NEOX_TOKENIZER, checkpoint / "tokenizer.json")
    from_dir = load_tokenizer(checkpoint, corpus=Corpus("", "x", "x"), cache_dir=tmp_path,
                              log=Log())
    assert from_dir.encode(SAMPLE, add_special_tokens=False).ids == ids


def test_tokenizer_path_errors(tmp_path):
    corpus = Corpus("", "x", "x")
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path, corpus=corpus, cache_dir=tmp_path, log=Log())
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json", corpus=corpus, cache_dir=tmp_path, log=Log())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="could not be loaded"):
        load_tokenizer(bad, corpus=corpus, cache_dir=tmp_path, log=Log())
    with pytest.raises(DataError, match="too small"):
        load_tokenizer(None, corpus=corpus, cache_dir=tmp_path, vocab_size=100, log=Log())


@pytest.fixture(scope="module")
def small_corpus() -> Corpus:
    # The stdlib help texts: always present, varied enough to train a few hundred merges.
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))[:150_000]
    return Corpus(text=text, name="pydoc_sample", source="test")


def test_bpe_is_trained_then_reused_from_cache(tmp_path, small_corpus):
    cache = tmp_path / "cache"
    log = Log()
    tokenizer = load_tokenizer(None, corpus=small_corpus, cache_dir=cache, vocab_size=600,
                               log=log)
    assert log.has("training a byte-level BPE")
    assert tokenizer.get_vocab_size() == 600
    assert tokenizer.token_to_id("<|endoftext|>") is not None
    ids = tokenizer.encode(SAMPLE).ids
    assert tokenizer.decode(ids) == SAMPLE  # byte-level: any text, exactly back
    assert len(ids) < len(SAMPLE.encode())  # merges were learnt
    [cached] = cache.glob("bpe-600-*.json")
    stamp = cached.stat().st_mtime_ns

    log = Log()
    again = load_tokenizer(None, corpus=small_corpus, cache_dir=cache, vocab_size=600, log=log)
    assert log.has("reusing cached") and not log.has("training")
    assert cached.stat().st_mtime_ns == stamp
    assert again.to_str() == tokenizer.to_str()

    # Another size or another text is another cache entry.
    load_tokenizer(None, corpus=small_corpus, cache_dir=cache, vocab_size=520, log=Log())
    other = Corpus(small_corpus.text[:100_000], "other", "test")
    load_tokenizer(None, corpus=other, cache_dir=cache, vocab_size=600, log=Log())
    assert len(list(cache.glob("bpe-*.json"))) == 3


def test_check_vocab_rejects_a_tokenizer_larger_than_the_model(tmp_path, small_corpus):
    tokenizer = load_tokenizer(None, corpus=small_corpus, cache_dir=tmp_path, vocab_size=600,
                               log=Log())
    check_vocab(tokenizer, 600)  # exactly enough rows
    with pytest.raises(DataError, match="tokenizer larger than the vocabulary"):
        check_vocab(tokenizer, 599)


# ---------------------------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------------------------

def test_windows_shape_and_shift():
    dataset = TokenDataset(torch.arange(1003), seq_len=9, val_fraction=0.1)
    assert dataset.num_windows == 100  # 1003 // 10; the last 3 tokens fill no window
    assert (len(dataset.train), len(dataset.val)) == (90, 10)
    inputs, targets = batch(dataset.train, torch.tensor([0, 5, 89]))
    assert inputs.shape == targets.shape == (3, 9)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 0], torch.tensor([0, 50, 890]))
    assert torch.equal(targets, inputs + 1)  # the target is the next token
    val_inputs, _ = batch(dataset.val, [0])
    assert val_inputs[0, 0].item() == 900


def test_validation_split_is_disjoint_and_at_least_one_window():
    tokens = torch.arange(5000)
    dataset = TokenDataset(tokens, seq_len=15, val_fraction=0.25)
    train_tokens = set(dataset.train.windows.flatten().tolist())
    val_tokens = set(dataset.val.windows.flatten().tolist())
    assert not train_tokens & val_tokens
    assert len(dataset.val) == round(0.25 * dataset.num_windows)
    assert min(val_tokens) > max(train_tokens)  # the held-out part is the end of the text

    tiny = TokenDataset(torch.arange(20), seq_len=9, val_fraction=0.0)
    assert (len(tiny.train), len(tiny.val)) == (1, 1)
    most = TokenDataset(torch.arange(50), seq_len=9, val_fraction=0.99)
    assert (len(most.train), len(most.val)) == (1, 4)


def test_too_short_corpus_says_what_is_needed():
    with pytest.raises(DataError, match=r"19 tokens.*seq_len=9 needs at least 20"):
        TokenDataset(torch.arange(19), seq_len=9)
    with pytest.raises(DataError, match="validation fraction"):
        TokenDataset(torch.arange(100), seq_len=9, val_fraction=1.0)


def test_tokens_are_cached(tmp_path, small_corpus):
    tokenizer = load_tokenizer(None, corpus=small_corpus, cache_dir=tmp_path, vocab_size=600,
                               log=Log())
    log = Log()
    first = TokenDataset.from_corpus(small_corpus, tokenizer, seq_len=32, cache_dir=tmp_path,
                                     log=log)
    assert log.has("tokenised")
    [cached] = tmp_path.glob("tokens-*.npy")
    expected = tokenizer.encode(small_corpus.text, add_special_tokens=False).ids
    assert np.load(cached).tolist() == expected

    log = Log()
    second = TokenDataset.from_corpus(small_corpus, tokenizer, seq_len=32, cache_dir=tmp_path,
                                      log=log)
    assert log.has("from cache") and not log.has("tokenised")
    assert torch.equal(first.tokens, second.tokens)

    cached.write_bytes(b"garbage")  # a damaged cache is noticed and rewritten
    log = Log()
    third = TokenDataset.from_corpus(small_corpus, tokenizer, seq_len=32, cache_dir=tmp_path,
                                     log=log)
    assert log.has("unreadable") and torch.equal(third.tokens, first.tokens)
    assert np.load(cached).tolist() == expected


# ---------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------

def epoch_batches(num_samples, world_size, batch_size, seed, epoch=0):
    """Every rank's batches for one epoch: a list (per rank) of lists of index lists."""
    per_rank = []
    for rank in range(world_size):
        sampler = WindowSampler(num_samples, rank=rank, world_size=world_size,
                                batch_size=batch_size, seed=seed)
        if epoch:
            sampler.load_state_dict({"epoch": epoch, "batches_done": 0, "seed": seed})
        per_rank.append([sampler.next_batch().tolist() for _ in range(sampler.steps_per_epoch)])
        assert sampler.epoch == epoch + 1 and sampler.batches_done == 0
    return per_rank


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_one_epoch_covers_each_kept_sample_once_across_ranks(world_size):
    num_samples, batch_size = 103, 4  # 103 is prime: every world size drops a remainder
    per_rank = epoch_batches(num_samples, world_size, batch_size, seed=7)
    steps = num_samples // (world_size * batch_size)
    seen = [i for batches in per_rank for b in batches for i in b]
    assert all(len(batches) == steps for batches in per_rank)
    assert all(len(b) == batch_size for batches in per_rank for b in batches)
    assert len(seen) == len(set(seen)) == steps * world_size * batch_size
    # Exactly the kept prefix of the epoch's permutation; nothing outside it.
    sampler = WindowSampler(num_samples, rank=0, world_size=world_size, batch_size=batch_size,
                            seed=7)
    assert sorted(seen) == sorted(sampler.permutation(0)[: len(seen)].tolist())
    # Ranks are disjoint.
    rank_sets = [{i for b in batches for i in b} for batches in per_rank]
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not rank_sets[a] & rank_sets[b]


def test_sampler_is_deterministic_and_reshuffles_per_epoch():
    same = epoch_batches(50, 2, 5, seed=3)
    assert epoch_batches(50, 2, 5, seed=3) == same
    assert epoch_batches(50, 2, 5, seed=4) != same
    assert epoch_batches(50, 2, 5, seed=3, epoch=1) != same
    # The permutation comes from torch.Generator().manual_seed(seed + epoch).
    expected = torch.randperm(50, generator=torch.Generator().manual_seed(3 + 1))
    assert torch.equal(WindowSampler(50, rank=0, world_size=2, batch_size=5,
                                     seed=3).permutation(1), expected)


@pytest.mark.parametrize("stop_after", [4, 8, 9, 20])  # mid-epoch, last-but-one, boundary, later
def test_resume_continues_the_identical_sequence(stop_after):
    num_samples, world_size, batch_size = 58, 2, 3  # 9 steps per epoch, 4 samples dropped
    for rank in range(world_size):
        def make():
            return WindowSampler(num_samples, rank=rank, world_size=world_size,
                                 batch_size=batch_size, seed=11)

        reference = make()
        uninterrupted = [reference.next_batch().tolist() for _ in range(30)]

        first = make()
        before = [first.next_batch().tolist() for _ in range(stop_after)]
        state = first.state_dict()
        assert state["seed"] == 11
        assert state["epoch"] == stop_after // 9 and state["batches_done"] == stop_after % 9

        resumed = make()
        resumed.load_state_dict(dict(state))
        after = [resumed.next_batch().tolist() for _ in range(30 - stop_after)]
        assert before + after == uninterrupted

        # The brief's three keys alone are enough when the layout is unchanged.
        minimal = make()
        minimal.load_state_dict({k: state[k] for k in ("epoch", "batches_done", "seed")})
        assert minimal.next_batch().tolist() == after[0]


def test_iteration_and_step_counting():
    sampler = WindowSampler(40, rank=1, world_size=2, batch_size=4, seed=0)  # 5 steps per epoch
    assert sampler.steps_per_epoch == 5 and sampler.steps_until(3) == 15
    taken = [b for _, b in zip(range(7), sampler)]
    assert len(taken) == 7 and (sampler.epoch, sampler.batches_done) == (1, 2)
    assert sampler.steps_until(3) == 8 and sampler.steps_until(1) == 0


def test_resume_under_another_world_size_continues_the_permutation():
    num_samples, seed = 60, 5
    old = [WindowSampler(num_samples, rank=r, world_size=2, batch_size=3, seed=seed)
           for r in range(2)]
    consumed = {i for s in old for _ in range(4) for i in s.next_batch().tolist()}  # 24 samples
    state = old[0].state_dict()
    assert state["samples_done"] == 24

    new = [WindowSampler(num_samples, rank=r, world_size=3, batch_size=2, seed=seed)
           for r in range(3)]
    for sampler in new:
        sampler.load_state_dict(state)
    assert new[0].steps_left_in_epoch() == (60 - 24) // 6
    rest = [i for _ in range(new[0].steps_left_in_epoch()) for s in new
            for i in s.next_batch().tolist()]
    assert not consumed & set(rest) and len(set(rest)) == len(rest) == 36
    assert consumed | set(rest) == set(range(num_samples))
    assert all(s.epoch == 1 and s.samples_done == 0 for s in new)


def test_sampler_errors():
    with pytest.raises(DataError, match="fewer than one step needs"):
        WindowSampler(5, rank=0, world_size=2, batch_size=3, seed=0)
    with pytest.raises(DataError, match="rank 2"):
        WindowSampler(50, rank=2, world_size=2, batch_size=3, seed=0)
    sampler = WindowSampler(50, rank=0, world_size=2, batch_size=3, seed=0)
    state = sampler.state_dict()
    with pytest.raises(DataError, match="seed 0 but this run uses seed 1"):
        WindowSampler(50, rank=0, world_size=2, batch_size=3, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="saved for 50 training windows"):
        WindowSampler(51, rank=0, world_size=2, batch_size=3, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="lacks"):
        sampler.load_state_dict({"seed": 0})


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_batches_cover_every_sample_once(world_size):
    shares = [eval_batches(10, rank=r, world_size=world_size, batch_size=3)
              for r in range(world_size)]
    seen = sorted(i for share in shares for b in share for i in b.tolist())
    assert seen == list(range(10))
    assert all(len(b) <= 3 for share in shares for b in share)
