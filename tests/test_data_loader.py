"""From files to batches: every format end to end, the held-out split, packing, seeded order, resumption,
per-process rows, the run-directory cache, and the data errors raised while building a dataset."""

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dropless.core.config import ConfigError, DataConfig
from dropless.data import DataError, TokenStream, document_order, load_token_dataset, reorder, split_point
from dropless.data import loader as loader_lib
from dropless.data import tokenizer as tokenizer_lib

VOCAB = 300
SEQ = 16
WORDS = ["alpha", "beta", "gamma", "delta", "return", "value", "print", "lambda", "self", "def"]


def _documents(count, seed=0):
    rng = np.random.default_rng(seed)
    return [f"doc{i:04d} " + " ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) for i in range(count)]


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _cfg(source, **kw):
    return DataConfig(source=str(source), **kw)


def _stream(stream: TokenStream) -> np.ndarray:
    return np.concatenate(stream.segments) if stream.segments else np.zeros(0, np.int64)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A 200-document jsonl corpus loaded once with a run directory: (docs, dataset, tokenizer, run_dir, cfg)."""
    root = tmp_path_factory.mktemp("text")
    docs = _documents(200)
    cfg = _cfg(_write_jsonl(root / "docs.jsonl", docs), eval_fraction=0.1, shuffle_seed=3)
    dataset, tokenizer = load_token_dataset(cfg, VOCAB, SEQ, root / "run")
    return docs, dataset, tokenizer, root / "run", cfg


# ---------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_text_formats_load_and_round_trip(tmp_path, fmt):
    docs = _documents(60)
    if fmt == "txt":
        for i, doc in enumerate(docs):
            (tmp_path / f"{i:03d}.txt").write_text(doc)
        source = tmp_path
    elif fmt == "jsonl":
        source = _write_jsonl(tmp_path / "d.jsonl", docs)
    else:
        source = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": docs}), source)
    dataset, tokenizer = load_token_dataset(_cfg(source), VOCAB, SEQ)
    stream = np.concatenate([_stream(dataset.train_stream), _stream(dataset.eval_stream)])
    order = document_order(len(docs), 0)
    assert tokenizer.decode(stream) == "".join(docs[i] + tokenizer.eos_token for i in order)
    batch = dataset.train_batch(0, 4)
    assert batch.shape == (4, SEQ + 1) and batch.dtype == np.int32


@pytest.mark.parametrize("fmt", ["npy", "bin"])
def test_token_formats_load_as_they_are(tmp_path, fmt):
    files = [np.arange(i * 1000, i * 1000 + 700) % VOCAB for i in range(3)]
    for i, tokens in enumerate(files):
        if fmt == "npy":
            np.save(tmp_path / f"{i}.npy", tokens.astype(np.int32))
        else:
            tokens.astype("<u2").tofile(tmp_path / f"{i}.bin")
    dataset, tokenizer = load_token_dataset(_cfg(tmp_path / f"*.{fmt}", eval_fraction=0.2), VOCAB, SEQ)
    assert tokenizer is None
    stream = np.concatenate([_stream(dataset.train_stream), _stream(dataset.eval_stream)])
    np.testing.assert_array_equal(stream, np.concatenate([files[i] for i in document_order(3, 0)]))
    # Whole files split: 2100 tokens, 20% asked, so the last file in the seeded order is held out.
    assert len(dataset.eval_stream) == 700
    assert all(isinstance(s, np.memmap) for s in dataset.train_stream.segments)


def test_stdlib_corpus_end_to_end(tmp_path):
    dataset, tokenizer = load_token_dataset(DataConfig(max_bytes=60_000), VOCAB, SEQ, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    text = tokenizer.decode(dataset.train_batch(0, 2)[0])
    assert len(text) > SEQ  # real source text, several characters per token
    assert dataset.num_train_sequences > 100


# --------------------------------------------------------------------------------- split and packing


def test_split_is_by_whole_documents_and_disjoint(text_run):
    docs, dataset, tokenizer, _, cfg = text_run
    eos = tokenizer.eos_token
    train_docs = tokenizer.decode(_stream(dataset.train_stream)).split(eos)
    eval_docs = tokenizer.decode(_stream(dataset.eval_stream)).split(eos)
    assert train_docs[-1] == "" and eval_docs[-1] == ""  # each split ends at a document's end
    train_docs, eval_docs = set(train_docs[:-1]), set(eval_docs[:-1])
    assert train_docs.isdisjoint(eval_docs)
    assert train_docs | eval_docs == set(docs)
    total = len(dataset.train_stream) + len(dataset.eval_stream)
    assert cfg.eval_fraction <= len(dataset.eval_stream) / total <= 2 * cfg.eval_fraction


def test_split_point_prefers_the_document_boundary_at_or_before_the_target():
    lengths = np.array([30, 30, 30, 30, 30])  # target 10% of 150 = 15 tokens, at least one sequence of 17
    assert split_point(lengths, SEQ, 0.1) == 120  # eval = the last document (30 <= 2 * 17)


def test_split_point_cuts_inside_a_dominant_document():
    assert split_point(np.array([1000]), SEQ, 0.1) == 900
    assert split_point(np.array([100, 900]), SEQ, 0.1) == 900  # the boundary at 100 would hold out 900 tokens
    assert split_point(np.array([10, 990]), SEQ, 0.1) == 900  # the boundary at 10 would leave too little to train


def test_split_point_keeps_a_boundary_that_falls_exactly_on_the_target():
    assert split_point(np.array([30, 30, 30, 30, 30]), SEQ, 0.2) == 120  # 30 tokens asked: exactly the last document


def test_split_point_takes_a_boundary_holding_out_exactly_twice_the_target():
    assert split_point(np.array([50, 50]), SEQ, 0.25) == 50  # 25 asked, the boundary holds out 50 = 2 * 25


def test_split_point_takes_a_boundary_leaving_exactly_one_training_sequence():
    assert split_point(np.array([SEQ + 1, 23]), SEQ, 0.5) == SEQ + 1


def test_split_point_holds_out_at_least_one_sequence_of_seq_len_plus_one():
    assert split_point(np.array([1000]), SEQ, 0.01) == 1000 - (SEQ + 1)  # 10 tokens asked, 17 needed


def test_single_text_document_splits_into_contiguous_head_and_tail(tmp_path):
    (tmp_path / "book.txt").write_text(" ".join(_documents(80)))
    dataset, tokenizer = load_token_dataset(_cfg(tmp_path / "book.txt", eval_fraction=0.25), VOCAB, SEQ)
    full = tokenizer.encode((tmp_path / "book.txt").read_text()).tolist() + [tokenizer.eos_id]
    train, held_out = _stream(dataset.train_stream).tolist(), _stream(dataset.eval_stream).tolist()
    assert train + held_out == full
    assert len(held_out) == int(np.ceil(0.25 * len(full)))


def test_reorder_matches_concatenating_documents():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 9, size=20)
    tokens = rng.integers(0, 1000, size=lengths.sum()).astype(np.uint16)
    docs = np.split(tokens, np.cumsum(lengths)[:-1])
    order = document_order(20, 5)
    result = reorder(tokens, lengths, order)
    assert result.dtype == np.uint16
    np.testing.assert_array_equal(result, np.concatenate([docs[i] for i in order]))


def test_token_stream_windows_and_slices_across_segments():
    segments = [np.arange(0, 5), np.arange(5, 6), np.array([], dtype=np.int64), np.arange(6, 20)]
    stream = TokenStream(segments)
    flat = np.arange(20)
    assert len(stream) == 20
    starts = np.array([0, 3, 4, 5, 13])
    np.testing.assert_array_equal(stream.windows(starts, 7), np.stack([flat[s:s + 7] for s in starts]))
    np.testing.assert_array_equal(_stream(stream.slice(4, 17)), flat[4:17])
    assert len(stream.slice(7, 7)) == 0


def test_batches_are_stride_seq_len_windows_of_the_train_stream(text_run):
    _, dataset, _, _, _ = text_run
    stream = _stream(dataset.train_stream)
    indices = dataset.train_indices(3, 8)
    batch = dataset.train_batch(3, 8)
    np.testing.assert_array_equal(batch, np.stack([stream[i * SEQ:i * SEQ + SEQ + 1] for i in indices]))
    assert dataset.num_train_sequences == (len(stream) - 1) // SEQ


def test_a_stream_of_a_whole_number_of_seq_len_leaves_its_last_sequence_unused():
    """Sequence i needs tokens [i*S, i*S + S + 1): k*S tokens hold k-1 sequences (the last lacks its final target)."""
    dataset = loader_lib.TokenDataset(TokenStream([np.arange(3 * SEQ)]), TokenStream([np.arange(2 * SEQ)]), SEQ, 0)
    assert dataset.num_train_sequences == 2 and dataset.num_eval_sequences == 1
    rows = np.concatenate([dataset.train_batch(step, 2) for step in range(3)])
    np.testing.assert_array_equal(np.unique(rows[:, 0]), [0, SEQ])


# ------------------------------------------------------------------------------- order and resumption


def test_each_epoch_visits_every_sequence_once_in_a_new_order(text_run):
    _, dataset, _, _, _ = text_run
    n, batch_size = dataset.num_train_sequences, 7
    steps = 2 * n // batch_size + 2
    seen = np.concatenate([dataset.train_indices(s, batch_size) for s in range(steps)])
    first, second = seen[:n], seen[n:2 * n]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, np.arange(n))


def test_batches_are_a_pure_function_of_seed_and_step(text_run, tmp_path):
    docs, dataset, _, _, cfg = text_run
    again, _ = load_token_dataset(cfg, VOCAB, SEQ, tmp_path / "other-run")  # a fresh instance, no shared cache
    for step in (0, 1, 57, 3):  # any order: no hidden iterator state
        np.testing.assert_array_equal(again.train_batch(step, 5), dataset.train_batch(step, 5))
    other_seed, _ = load_token_dataset(_cfg(cfg.source, eval_fraction=0.1, shuffle_seed=4), VOCAB, SEQ)
    assert not np.array_equal(other_seed.train_batch(0, 5), dataset.train_batch(0, 5))


def test_neighbouring_seeds_do_not_share_epoch_orders():
    """The order of epoch e is drawn from (seed, e): seed 4's first epoch is not seed 3's second."""
    stream = TokenStream([np.arange(100 * SEQ + 1)])
    three, four = (loader_lib.TokenDataset(stream, stream, SEQ, seed) for seed in (3, 4))
    assert not np.array_equal(four.train_indices(0, 100), three.train_indices(1, 100))


def test_resumed_prefetch_sees_the_batches_of_an_uninterrupted_run(text_run):
    _, dataset, _, run_dir, cfg = text_run
    batch_size = 8
    steps = dataset.num_train_sequences // batch_size * 2 + 3  # crosses two epoch boundaries
    with dataset.prefetch(0, batch_size, steps) as batches:
        uninterrupted = list(batches)
    assert len(uninterrupted) == steps
    resumed_dataset, _ = load_token_dataset(cfg, VOCAB, SEQ, run_dir)  # from the run directory's cache
    resume_at = steps // 2
    with resumed_dataset.prefetch(resume_at, batch_size, steps, depth=2) as batches:
        resumed = list(batches)
    for a, b in zip(uninterrupted[resume_at:], resumed, strict=True):
        np.testing.assert_array_equal(a, b)


def test_prefetch_depth_defaults_to_the_config_and_transform_runs(text_run):
    _, dataset, _, _, cfg = text_run
    assert dataset.prefetch_depth == cfg.prefetch
    with dataset.prefetch(2, 4, 4, transform=lambda b: b.sum()) as sums:
        assert list(sums) == [dataset.train_batch(2, 4).sum(), dataset.train_batch(3, 4).sum()]


# -------------------------------------------------------------------------------- processes and eval


def test_process_rows_assemble_the_global_batch(text_run):
    _, dataset, _, _, _ = text_run
    parts = [dataset.train_batch(5, 8, process_index=p, process_count=4) for p in range(4)]
    assert all(p.shape == (2, SEQ + 1) for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), dataset.train_batch(5, 8))
    eval_parts = [dataset.eval_batches(3, 8, p, 2) for p in range(2)]
    for b, global_batch in enumerate(dataset.eval_batches(3, 8)):
        np.testing.assert_array_equal(np.concatenate([eval_parts[0][b], eval_parts[1][b]]), global_batch)
    with pytest.raises(DataError, match=r"train.batch_size=8 must be a multiple of the number of processes \(3\)"):
        dataset.train_batch(0, 8, process_index=0, process_count=3)


def test_eval_batches_are_fixed_held_out_and_spread(text_run):
    _, dataset, _, _, _ = text_run
    first, second = dataset.eval_batches(2, 4), dataset.eval_batches(2, 4)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    held_out = _stream(dataset.eval_stream)
    windows = {tuple(held_out[i * SEQ:i * SEQ + SEQ + 1]) for i in range(dataset.num_eval_sequences)}
    rows = [tuple(row) for batch in first for row in batch]
    assert set(rows) <= windows
    assert len(set(rows)) == min(8, dataset.num_eval_sequences)  # distinct while there are enough


def test_eval_batches_are_the_held_out_sequences_at_even_steps_over_the_whole_stream(text_run):
    """Row i of the 8 evaluation rows is held-out sequence floor(i * N / 8): the first and the last eighth of the
    held-out stream are both read, not only its head."""
    _, dataset, _, _, _ = text_run
    held_out = _stream(dataset.eval_stream)
    count, n = 8, dataset.num_eval_sequences
    want = [held_out[j * SEQ:j * SEQ + SEQ + 1] for j in (i * n // count for i in range(count))]
    rows = [row for batch in dataset.eval_batches(2, 4) for row in batch]
    np.testing.assert_array_equal(np.stack(rows), np.stack(want))


def test_eval_batches_repeat_when_the_held_out_split_is_small(tmp_path):
    source = _write_jsonl(tmp_path / "d.jsonl", _documents(30))
    dataset, _ = load_token_dataset(_cfg(source, eval_fraction=0.01), VOCAB, SEQ)
    batches = dataset.eval_batches(4, 8)
    assert len(batches) == 4 and all(b.shape == (8, SEQ + 1) for b in batches)


# ------------------------------------------------------------------------------- run-directory cache


def test_a_second_load_reuses_the_run_directory_without_retraining(text_run, monkeypatch):
    _, dataset, tokenizer, run_dir, cfg = text_run
    assert (run_dir / "tokenizer.json").is_file() and len(list((run_dir / "corpus").glob("tokens-*.npz"))) == 1

    def forbidden(*args, **kwargs):
        raise AssertionError("the run directory's cache should have been used")

    monkeypatch.setattr(loader_lib, "train_bpe", forbidden)
    monkeypatch.setattr(tokenizer_lib.TextTokenizer, "encode_batch", forbidden)
    again, again_tokenizer = load_token_dataset(cfg, VOCAB, SEQ, run_dir)
    assert again_tokenizer.to_str() == tokenizer.to_str()
    np.testing.assert_array_equal(again.train_batch(9, 4), dataset.train_batch(9, 4))


def test_a_changed_corpus_or_vocabulary_retrains_the_tokenizer(tmp_path):
    first = _write_jsonl(tmp_path / "a.jsonl", _documents(50, seed=1))
    _, tokenizer = load_token_dataset(_cfg(first), VOCAB, SEQ, tmp_path / "run")
    _, bigger = load_token_dataset(_cfg(first), VOCAB + 20, SEQ, tmp_path / "run")
    assert bigger.vocab_size > tokenizer.vocab_size
    second = _write_jsonl(tmp_path / "b.jsonl", ["zzz qqq xxx " * 20] * 30)
    _, other = load_token_dataset(_cfg(second), VOCAB + 20, SEQ, tmp_path / "run")
    assert other.to_str() != bigger.to_str()
    assert len(list((tmp_path / "run" / "corpus").glob("tokens-*.npz"))) == 1  # stale caches are removed


def test_a_changed_max_bytes_retrains_the_tokenizer_of_the_stdlib_corpus(tmp_path):
    load_token_dataset(DataConfig(max_bytes=20_000), VOCAB, SEQ, tmp_path / "run")
    _, reloaded = load_token_dataset(DataConfig(max_bytes=40_000), VOCAB, SEQ, tmp_path / "run")
    _, fresh = load_token_dataset(DataConfig(max_bytes=40_000), VOCAB, SEQ)
    assert reloaded.to_str() == fresh.to_str()


def test_a_given_tokenizer_is_used_and_copied_to_the_run_directory(text_run, tmp_path):
    docs, _, tokenizer, _, _ = text_run
    tokenizer.save(tmp_path / "given.json")
    source = _write_jsonl(tmp_path / "d.jsonl", docs[:50])
    _, used = load_token_dataset(_cfg(source, tokenizer=str(tmp_path / "given.json")), VOCAB, SEQ, tmp_path / "run")
    assert used.to_str() == tokenizer.to_str()
    assert (tmp_path / "run" / "tokenizer.json").read_text() == (tmp_path / "given.json").read_text()


# -------------------------------------------------------------------------------------------- errors


def test_given_tokenizer_larger_than_the_model(text_run, tmp_path):
    _, _, tokenizer, _, cfg = text_run
    tokenizer.save(tmp_path / "given.json")
    with pytest.raises(DataError, match=f"has {tokenizer.vocab_size} tokens but model.vocab_size=280"):
        load_token_dataset(_cfg(cfg.source, tokenizer=str(tmp_path / "given.json")), 280, SEQ)


def test_missing_tokenizer_file(text_run, tmp_path):
    _, _, _, _, cfg = text_run
    with pytest.raises(DataError, match="The tokenizer file .*missing.json does not exist"):
        load_token_dataset(_cfg(cfg.source, tokenizer=str(tmp_path / "missing.json")), VOCAB, SEQ)


def test_corpus_shorter_than_one_sequence(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(30))
    with pytest.raises(DataError, match=r"has 30 tokens but needs at least 34: one sequence of "
                                        r"train.seq_len\+1=17 tokens for training and one for evaluation"):
        load_token_dataset(_cfg(tmp_path / "t.npy"), VOCAB, SEQ)


def test_token_id_beyond_the_vocabulary(tmp_path):
    tokens = np.arange(500)
    np.save(tmp_path / "t.npy", tokens)
    with pytest.raises(DataError, match="holds token id 499, beyond the vocabulary of model.vocab_size=300; "
                                        "re-tokenize it with the model's tokenizer, or for a new model set "
                                        "model.vocab_size=500 "):
        load_token_dataset(_cfg(tmp_path / "t.npy"), VOCAB, SEQ)
    np.save(tmp_path / "t.npy", tokens - 1)
    with pytest.raises(DataError, match="holds the negative token id -1"):
        load_token_dataset(_cfg(tmp_path / "t.npy"), 1000, SEQ)


def test_token_id_equal_to_the_vocabulary_size(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(VOCAB + 1))
    with pytest.raises(DataError, match=f"holds token id {VOCAB}, beyond the vocabulary of model.vocab_size={VOCAB}"):
        load_token_dataset(_cfg(tmp_path / "t.npy"), VOCAB, SEQ)
    np.save(tmp_path / "t.npy", np.arange(VOCAB))
    load_token_dataset(_cfg(tmp_path / "t.npy"), VOCAB, SEQ)  # the largest id, VOCAB - 1, fits


def test_empty_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("")
    _write_jsonl(tmp_path / "b.jsonl", [""])
    with pytest.raises(DataError, match=r"holds no text \(its 2 file\(s\) are empty or were skipped\)"):
        load_token_dataset(_cfg(tmp_path), VOCAB, SEQ)
    np.save(tmp_path / "t.npy", np.zeros(0, np.int32))
    with pytest.raises(DataError, match=r"holds no tokens \(all 1 files are empty\)"):
        load_token_dataset(_cfg(tmp_path / "t.npy"), VOCAB, SEQ)


def test_corpus_of_only_undecodable_files(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xff\xff")
    with pytest.warns(UserWarning, match="Skipping .*a.txt: it is not valid UTF-8"):
        with pytest.raises(DataError, match="holds no text"):
            load_token_dataset(_cfg(tmp_path), VOCAB, SEQ)


def test_a_damaged_token_cache_is_rebuilt(text_run, tmp_path):
    _, dataset, _, run_dir, cfg = text_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (cache,) = (copy / "corpus").glob("tokens-*.npz")
    cache.write_bytes(cache.read_bytes()[:100])  # torn, as by a failing disk
    again, _ = load_token_dataset(cfg, VOCAB, SEQ, copy)
    np.testing.assert_array_equal(again.train_batch(9, 4), dataset.train_batch(9, 4))
    assert cache.stat().st_size > 100  # written again, whole


def test_a_token_cache_whose_lengths_do_not_add_up_is_rebuilt(text_run, tmp_path):
    _, dataset, _, run_dir, cfg = text_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (cache,) = (copy / "corpus").glob("tokens-*.npz")
    with np.load(cache) as cached:
        tokens, lengths = cached["tokens"], cached["lengths"]
    np.savez(cache.with_suffix(""), tokens=tokens[:-5], lengths=lengths)  # a well-formed file, inconsistent
    again, _ = load_token_dataset(cfg, VOCAB, SEQ, copy)
    np.testing.assert_array_equal(_stream(again.train_stream), _stream(dataset.train_stream))
    np.testing.assert_array_equal(_stream(again.eval_stream), _stream(dataset.eval_stream))


def test_a_resumed_run_reads_its_own_tokenizer_whatever_the_cache_says(tmp_path):
    """A run copied without its token cache (corpus/), whose data then changed: a new run there trains a tokenizer
    on the new data, but a resumed one (weights trained with the old tokenizer) reads RUN/tokenizer.json as it is,
    and refuses in one line where it is missing."""
    cfg = _cfg(_write_jsonl(tmp_path / "docs.jsonl", _documents(120)), eval_fraction=0.1)
    load_token_dataset(cfg, VOCAB, SEQ, tmp_path / "run")
    saved = (tmp_path / "run" / "tokenizer.json").read_bytes()
    _write_jsonl(tmp_path / "docs.jsonl", _documents(120, seed=7)[::-1])  # other text at the same path
    for resume in (True, False):
        copy = tmp_path / f"copy-{resume}"
        shutil.copytree(tmp_path / "run", copy, ignore=shutil.ignore_patterns("corpus"))
        load_token_dataset(cfg, VOCAB, SEQ, copy, resume=resume)
        assert ((copy / "tokenizer.json").read_bytes() == saved) == resume, resume
    (copy := tmp_path / "copy-True" / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer.json is missing, and the run's weights were trained with it"):
        load_token_dataset(cfg, VOCAB, SEQ, copy.parent, resume=True)


# ---------------------------------------------------------------------------------------- a held-out corpus


def test_an_evaluation_corpus_of_its_own_is_read_whole_and_the_training_corpus_is_not_split(tmp_path):
    """data.eval_source: the held-out stream is that corpus, its documents in file order each followed by the
    end-of-document token, encoded by the run's tokenizer; every document of data.source is trained on."""
    train_docs, eval_docs = _documents(80), _documents(12, seed=7)
    cfg = _cfg(_write_jsonl(tmp_path / "train.jsonl", train_docs), eval_source=str(tmp_path / "valid"))
    (tmp_path / "valid").mkdir()
    for i, doc in enumerate(eval_docs):
        (tmp_path / "valid" / f"{i:02d}.txt").write_text(doc)
    dataset, tokenizer = load_token_dataset(cfg, VOCAB, SEQ)
    assert tokenizer.decode(_stream(dataset.eval_stream)) == "".join(d + tokenizer.eos_token for d in eval_docs)
    order = document_order(len(train_docs), 0)
    assert tokenizer.decode(_stream(dataset.train_stream)) == "".join(train_docs[i] + tokenizer.eos_token
                                                                      for i in order)
    assert "evaluated on data.eval_source" in repr(dataset)
    evaluation = dataset.eval_batches(2, 4)
    assert all(batch.shape == (4, SEQ + 1) for batch in evaluation)


def test_a_token_corpus_evaluated_on_token_files(tmp_path):
    np.save(tmp_path / "train.npy", np.arange(2000, dtype=np.int32) % VOCAB)
    np.save(tmp_path / "valid.npy", (np.arange(100, dtype=np.int32) * 7) % VOCAB)
    dataset, _ = load_token_dataset(_cfg(tmp_path / "train.npy", eval_source=str(tmp_path / "valid.npy")), VOCAB, SEQ)
    np.testing.assert_array_equal(_stream(dataset.eval_stream), (np.arange(100) * 7) % VOCAB)
    np.testing.assert_array_equal(_stream(dataset.train_stream), np.arange(2000) % VOCAB)


def test_an_evaluation_corpus_that_cannot_serve_is_refused(tmp_path, monkeypatch):
    np.save(tmp_path / "train.npy", np.arange(2000, dtype=np.int32) % VOCAB)
    np.save(tmp_path / "tiny.npy", np.arange(SEQ, dtype=np.int32))
    (tmp_path / "valid.txt").write_text("some text")
    with pytest.raises(DataError, match=rf"^data.eval_source '.*tiny.npy' has {SEQ} tokens, fewer than one sequence "
                                        rf"of train.seq_len\+1={SEQ + 1}; give more data or lower train.seq_len.$"):
        load_token_dataset(_cfg(tmp_path / "train.npy", eval_source=str(tmp_path / "tiny.npy")), VOCAB, SEQ)
    with pytest.raises(DataError, match=r"^data.eval_source '.*valid.txt' is text and no tokenizer is given"):
        load_token_dataset(_cfg(tmp_path / "train.npy", eval_source=str(tmp_path / "valid.txt")), VOCAB, SEQ)
    with pytest.raises(DataError, match=r"^data.eval_source '.*missing' does not exist"):
        load_token_dataset(_cfg(tmp_path / "train.npy", eval_source=str(tmp_path / "missing")), VOCAB, SEQ)
    with pytest.raises(ConfigError, match=r"^data.eval_source is data.source \('x.npy'\), so the model would be "
                                          r"evaluated on the data it trains on"):
        DataConfig(source="x.npy", eval_source="x.npy")
    monkeypatch.chdir(tmp_path.parent)
    for spelling in (f"./{tmp_path.name}/train.npy", f"{tmp_path}/*.npy"):  # the same file, another spelling
        with pytest.raises(DataError, match=r"^data.eval_source '.*' shares 1 file\(s\) with data.source '.*train.npy' "
                                            r"\(e.g. .*train.npy\), so the model would be evaluated on data it trains on"):
            load_token_dataset(DataConfig(source=str(tmp_path / "train.npy"), eval_source=spelling), VOCAB, SEQ)


def test_a_text_evaluation_corpus_is_tokenized_once_per_run(tmp_path):
    """Its tokens are cached in RUN_DIR/corpus/ beside the training corpus's (neither replaces the other), so a
    resumed run reads both from there."""
    cfg = _cfg(_write_jsonl(tmp_path / "train.jsonl", _documents(60)),
               eval_source=str(_write_jsonl(tmp_path / "valid.jsonl", _documents(8, seed=5))))
    lines = []
    first, _ = load_token_dataset(cfg, VOCAB, SEQ, tmp_path / "run", lines.append)
    assert sum("tokenizing" in line for line in lines) == 2
    lines.clear()
    again, _ = load_token_dataset(cfg, VOCAB, SEQ, tmp_path / "run", lines.append, resume=True)
    assert not [line for line in lines if "tokenizing" in line]
    np.testing.assert_array_equal(_stream(again.eval_stream), _stream(first.eval_stream))
    np.testing.assert_array_equal(_stream(again.train_stream), _stream(first.train_stream))
