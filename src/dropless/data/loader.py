"""From a corpus to batches: tokenize (cached in the run directory), split, pack, shuffle, prefetch.

Semantics, in order:
1. Documents. Text corpora: one per `.py`/`.txt` file, `.jsonl` line or `.parquet` row, each followed by the
   end-of-document token. Token corpora: one per `.npy`/`.bin` file, taken as they are (no separator added).
2. Split by documents. The documents are put in a seeded random order (`data.shuffle_seed`); the last ones
   form the held-out split, enough to hold `data.eval_fraction` of the tokens (and at least one sequence).
   So no document is in both splits. Only when that would take more than twice the asked-for tokens (one
   document dominates, e.g. a single big file) does the cut fall inside a document, which then contributes
   a contiguous head to training and its tail to evaluation. With `data.eval_source`, that corpus (its
   documents in file order) is the held-out data instead, and every document of `data.source` is trained on.
3. Packing. Each split is a token stream cut into sequences of `seq_len + 1` tokens with stride `seq_len`
   (sequence i = stream[i*S : i*S + S + 1]; consecutive sequences share one token, so every token is a
   target exactly once). Sequences cross document boundaries; the trailing partial sequence is unused.
4. Order. Epoch e visits the training sequences in the permutation drawn from `(shuffle_seed, e)`; the
   global batch of step n holds the sequences at positions n*B ... n*B+B-1 of the concatenated epochs. The
   batch is a pure function of (seed, step), so a resumed run sees exactly the batches of an uninterrupted one.
5. Evaluation uses a fixed set of held-out sequences, spread evenly over the held-out stream.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from dropless.core.config import DataConfig
from dropless.core.files import write_atomic
from dropless.data import corpus as corpus_lib
from dropless.data.corpus import Corpus, DataError
from dropless.data.prefetch import Prefetcher
from dropless.data.tokenizer import TRAINED_EOS_ID, TextTokenizer, load_tokenizer, train_bpe

TOKENIZER_FILE = "tokenizer.json"  # RUN_DIR/tokenizer.json: the tokenizer the run was trained with
CACHE_DIR = "corpus"  # RUN_DIR/corpus/: the tokenized corpus and where the tokenizer came from
ORIGIN_FILE = "tokenizer-origin.json"  # under CACHE_DIR: where the run's tokenizer came from
TOKEN_PREFIX = "tokens"  # under CACHE_DIR: the tokenized corpus, tokens-<key>.npz
TOKEN_CACHE = f"{TOKEN_PREFIX}-*.npz"
EVAL_PREFIX = "eval-tokens"  # under CACHE_DIR: the tokenized data.eval_source, eval-tokens-<key>.npz
EVAL_TOKEN_CACHE = f"{EVAL_PREFIX}-*.npz"
_ENCODE_CHUNK_CHARS = 4_000_000  # encode in chunks to bound the memory of HF Encoding objects


class TokenStream:
    """A read-only concatenation of 1-D token arrays; memory-mapped segments are read only where used."""

    def __init__(self, segments: Sequence[np.ndarray]):
        self.segments = [s for s in segments if len(s)]
        self.ends = np.cumsum([len(s) for s in self.segments], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def slice(self, start: int, stop: int) -> "TokenStream":
        """Tokens [start, stop) as a new stream (views, no copy)."""
        pieces = []
        for segment, end in zip(self.segments, self.ends):
            begin = int(end) - len(segment)
            lo, hi = max(start, begin), min(stop, int(end))
            if lo < hi:
                pieces.append(segment[lo - begin:hi - begin])
        return TokenStream(pieces)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows stream[s : s + length] for each s in `starts`, as int32 [len(starts), length]."""
        out = np.empty((len(starts), length), dtype=np.int32)
        for row, start in enumerate(np.asarray(starts, dtype=np.int64)):
            assert 0 <= start and start + length <= len(self)
            filled = 0
            segment_index = int(np.searchsorted(self.ends, start, side="right"))
            while filled < length:
                segment = self.segments[segment_index]
                begin = int(self.ends[segment_index]) - len(segment)
                offset = start + filled - begin
                piece = segment[offset:offset + length - filled]
                out[row, filled:filled + len(piece)] = piece
                filled += len(piece)
                segment_index += 1
        return out


def document_order(num_documents: int, seed: int) -> np.ndarray:
    """The seeded random order of the documents; the held-out split is taken from its end."""
    return np.random.default_rng(seed).permutation(num_documents)


def split_point(lengths: np.ndarray, seq_len: int, eval_fraction: float, corpus_name: str = "the corpus") -> int:
    """Where to cut a stream of documents of `lengths` (in stream order) into (train, eval)."""
    total = int(lengths.sum())
    sequence = seq_len + 1
    if total < 2 * sequence:
        raise DataError(f"{corpus_name} has {total} tokens but needs at least {2 * sequence}: one sequence of "
                        f"train.seq_len+1={sequence} tokens for training and one for evaluation; give more data "
                        "or lower train.seq_len.")
    target = max(math.ceil(eval_fraction * total), sequence)
    cut = total - target
    boundaries = np.concatenate([[0], np.cumsum(lengths)])
    at_boundary = int(boundaries[np.searchsorted(boundaries, cut, side="right") - 1])  # last boundary <= cut
    if at_boundary >= sequence and total - at_boundary <= 2 * target:
        cut = at_boundary
    assert cut >= sequence and total - cut >= sequence
    return cut


def reorder(tokens: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The documents of the flat `tokens` (of `lengths`) concatenated in `order`, in one vectorized gather."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    new_lengths = lengths[order]
    new_starts = np.concatenate([[0], np.cumsum(new_lengths)[:-1]])
    index = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts[order] - new_starts, new_lengths)
    return tokens[index]


class TokenDataset:
    """Packed, shuffled training batches and fixed evaluation batches, as int32 [B, S+1] numpy arrays.

    Inputs are `batch[:, :-1]`, targets `batch[:, 1:]`. With several processes, each asks for its own rows
    (`process_index`, `process_count`): rows [p*B/P, (p+1)*B/P) of the global batch.
    """

    def __init__(self, train: TokenStream, eval: TokenStream, seq_len: int, seed: int, prefetch_depth: int = 2,
                 description: str = ""):
        self.train_stream, self.eval_stream = train, eval
        self.seq_len, self.seed, self.prefetch_depth = seq_len, seed, prefetch_depth
        self.num_train_sequences = max(len(train) - 1, 0) // seq_len
        self.num_eval_sequences = max(len(eval) - 1, 0) // seq_len
        assert self.num_train_sequences > 0 and self.num_eval_sequences > 0
        self.description = description
        self._permutations: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"TokenDataset({self.description + ': ' if self.description else ''}"
                f"{len(self.train_stream):,} train tokens in {self.num_train_sequences:,} sequences, "
                f"{len(self.eval_stream):,} held-out tokens, seq_len={self.seq_len})")

    def _permutation(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._permutations:
                if len(self._permutations) >= 2:  # the batch being served and the next epoch's are enough
                    del self._permutations[min(self._permutations)]
                rng = np.random.default_rng([self.seed, epoch])
                self._permutations[epoch] = rng.permutation(self.num_train_sequences)
            return self._permutations[epoch]

    def train_indices(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """Indices of the training sequences in this process's rows of the global batch at `step`."""
        lo, hi = _process_rows(batch_size, process_index, process_count)
        positions = step * batch_size + np.arange(lo, hi, dtype=np.int64)
        epochs, within = np.divmod(positions, self.num_train_sequences)
        return np.array([self._permutation(int(e))[i] for e, i in zip(epochs, within)], dtype=np.int64)

    def train_batch(self, step: int, batch_size: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """The training batch of `step`, int32 [batch_size / process_count, seq_len + 1]."""
        indices = self.train_indices(step, batch_size, process_index, process_count)
        return self.train_stream.windows(indices * self.seq_len, self.seq_len + 1)

    def epoch(self, step: int, batch_size: int) -> float:
        """How many passes over the training sequences the first `step` steps made."""
        return step * batch_size / self.num_train_sequences

    def eval_batches(self, num_batches: int, batch_size: int, process_index: int = 0,
                     process_count: int = 1) -> list[np.ndarray]:
        """The fixed held-out batches: `num_batches * batch_size` sequences spread evenly over the held-out
        stream (repeating some when it holds fewer), each batch int32 [batch_size / process_count, S+1]."""
        lo, hi = _process_rows(batch_size, process_index, process_count)
        count = num_batches * batch_size
        indices = np.floor(np.arange(count) * (self.num_eval_sequences / count)).astype(np.int64)
        batches = indices.reshape(num_batches, batch_size)[:, lo:hi]
        return [self.eval_stream.windows(rows * self.seq_len, self.seq_len + 1) for rows in batches]

    def prefetch(self, start_step: int, batch_size: int, stop_step: int | None = None, depth: int | None = None,
                 process_index: int = 0, process_count: int = 1,
                 transform: Callable[[np.ndarray], object] | None = None) -> Prefetcher:
        """Training batches of steps [start_step, stop_step) from a background thread, `depth` ahead
        (default `data.prefetch`). `transform` (e.g. a device put) runs on that thread too."""
        _process_rows(batch_size, process_index, process_count)  # fail here, not in the thread

        def produce(step: int):
            batch = self.train_batch(step, batch_size, process_index, process_count)
            return transform(batch) if transform is not None else batch

        return Prefetcher(produce, start_step, stop_step, self.prefetch_depth if depth is None else depth)


def _process_rows(batch_size: int, process_index: int, process_count: int) -> tuple[int, int]:
    if batch_size % process_count:
        raise DataError(f"train.batch_size={batch_size} must be a multiple of the number of processes "
                        f"({process_count}); change the batch size.")
    assert 0 <= process_index < process_count
    rows = batch_size // process_count
    return process_index * rows, (process_index + 1) * rows


# ------------------------------------------------------------------------------------------ building


def load_token_dataset(data_cfg: DataConfig, vocab_size: int, seq_len: int, run_dir: str | Path | None = None,
                       log: Callable[[str], None] | None = None, *, resume: bool = False,
                       read_cache: str | Path | None = None) -> tuple[TokenDataset, TextTokenizer | None]:
    """Build the dataset of `data_cfg` for a model of `vocab_size` tokens; returns (dataset, tokenizer).

    The tokenizer is `data.tokenizer` if given, else a byte-level BPE trained on the corpus; it is None for a
    pre-tokenized corpus without `data.tokenizer`. With `run_dir`, the tokenizer is written to
    RUN_DIR/tokenizer.json and the tokenized corpus cached under RUN_DIR/corpus/, so a resumed run reuses both.
    `resume`: the run directory holds a run whose weights were trained with its tokenizer.json, which is then read
    as it is (never trained again over, whatever the cache says; DataError where it is missing). `read_cache`
    (without `run_dir`): a run directory whose token cache is read where it holds this corpus for this tokenizer,
    and never written (what `dropless eval` scores a run's own data with).
    """
    log = log or (lambda message: None)
    corpus = corpus_lib.resolve(data_cfg.source, data_cfg.max_bytes)
    cache_dir = Path(run_dir) / CACHE_DIR if run_dir is not None else None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    texts = functools.cache(lambda: _read_texts(corpus, log))
    tokenizer = _tokenizer(data_cfg, corpus, vocab_size, run_dir, cache_dir, texts, log, resume)
    if read_cache is not None and cache_dir is None:
        cache_dir, write = Path(read_cache) / CACHE_DIR, False
    else:
        write = True
    segments, lengths = _documents(corpus, tokenizer, vocab_size, cache_dir, texts, log, write=write)
    order = document_order(len(lengths), data_cfg.shuffle_seed)
    if corpus.kind == "text":
        # Text documents are small and many: one contiguous reordered copy makes batch gathers cheap.
        stream = TokenStream([reorder(segments[0], lengths, order)])
    else:
        # Token files may be huge memory maps: keep them as segments, read only where batches fall.
        stream = TokenStream([segments[i] for i in order])
    description = f"{corpus.name}, {len(lengths):,} documents"
    if data_cfg.eval_source:
        held_out_corpus = corpus_lib.resolve(data_cfg.eval_source, data_cfg.max_bytes, key="data.eval_source")
        shared = {p.resolve() for p in corpus.files} & {p.resolve() for p in held_out_corpus.files}
        if shared:
            raise DataError(f"{held_out_corpus.name} shares {len(shared)} file(s) with {corpus.name} (e.g. "
                            f"{min(shared)}), so the model would be evaluated on data it trains on; give a disjoint "
                            "corpus, or leave data.eval_source empty to hold out part of data.source.")
        train, held_out = stream, _whole_stream(held_out_corpus, tokenizer, vocab_size, log, cache_dir, write)
        for part, what in ((train, corpus.name), (held_out, held_out_corpus.name)):
            if len(part) < seq_len + 1:
                raise DataError(f"{what} has {len(part)} tokens, fewer than one sequence of train.seq_len+1="
                                f"{seq_len + 1}; give more data or lower train.seq_len.")
        description += f", evaluated on {held_out_corpus.name}"
    else:
        cut = split_point(lengths[order], seq_len, data_cfg.eval_fraction, corpus.name)
        train, held_out = stream.slice(0, cut), stream.slice(cut, len(stream))
    dataset = TokenDataset(train, held_out, seq_len, data_cfg.shuffle_seed, data_cfg.prefetch, description)
    log(f"dropless: data {dataset}")
    return dataset, tokenizer


def resolve_eos_id(data_cfg: DataConfig, vocab_size: int) -> int:
    """data.eos_id as a run with data.document_mask records it, checked before any data is read: the id that ends
    every document of data.source and data.eval_source. A text corpus's documents end in its tokenizer's
    end-of-document id, which the loader puts after each (data.tokenizer's, or TRAINED_EOS_ID for the tokenizer a
    run trains), so data.eos_id may only be unset (-1) or that id; a token corpus carries its own separators, so
    data.eos_id must name it. DataError, naming the corpus and the fix, otherwise. Without the mask, data.eos_id
    as it is."""
    if not data_cfg.document_mask:
        return data_cfg.eos_id
    eos_id = data_cfg.eos_id
    for setting in ("source", "eval_source"):
        if not getattr(data_cfg, setting):
            continue
        corpus = corpus_lib.resolve(getattr(data_cfg, setting), data_cfg.max_bytes, key=f"data.{setting}")
        if corpus.kind != "text":
            if data_cfg.eos_id < 0:
                raise DataError(f"data.document_mask splits sequences at end-of-document ids, and {corpus.name} "
                                "holds token ids with its own separators; name the id that ends each document with "
                                "data.eos_id=N.")
            continue
        ends = load_tokenizer(data_cfg.tokenizer, vocab_size).eos_id if data_cfg.tokenizer else TRAINED_EOS_ID
        if data_cfg.eos_id not in (-1, ends):
            raise DataError(f"data.eos_id={data_cfg.eos_id}, but the documents of {corpus.name} end in the "
                            f"tokenizer's end-of-document id {ends}; data.document_mask reads one id for all the "
                            "data, so leave data.eos_id unset (-1) where the data is text.")
        eos_id = ends
    return eos_id


def load_token_stream(data_cfg: DataConfig, vocab_size: int, log: Callable[[str], None] | None = None, *,
                      setting: str = "source", read_cache: str | Path | None = None) -> tuple[TokenStream, Corpus]:
    """Every document of `data.source` (or of the corpus another `setting` names, e.g. "eval_source") in file
    order, as training reads documents (step 1 above), unsplit and unshuffled: what `dropless eval` scores. A text
    corpus is encoded by `data.tokenizer`, which must be given (a model is scored with its own tokenizer, never a
    new one); nothing is cached, and `read_cache` (a run directory) is read where its cache holds these tokens."""
    corpus = corpus_lib.resolve(getattr(data_cfg, setting), data_cfg.max_bytes, key=f"data.{setting}")
    tokenizer = load_tokenizer(data_cfg.tokenizer, vocab_size) if data_cfg.tokenizer else None
    cache_dir = Path(read_cache) / CACHE_DIR if read_cache is not None else None
    return _whole_stream(corpus, tokenizer, vocab_size, log or (lambda message: None), cache_dir, False), corpus


def _whole_stream(corpus: Corpus, tokenizer: TextTokenizer | None, vocab_size: int, log,
                  cache_dir: Path | None = None, write: bool = True) -> TokenStream:
    """Every document of `corpus` in file order, text encoded by `tokenizer` (DataError where there is none);
    cached in `cache_dir`, or with `write` False only read from it."""
    if corpus.kind == "text" and tokenizer is None:
        raise DataError(f"{corpus.name} is text and no tokenizer is given; give the model's tokenizer.json "
                        "(--tokenizer, or data.tokenizer).")
    segments, _ = _documents(corpus, tokenizer, vocab_size, cache_dir,
                             functools.cache(lambda: _read_texts(corpus, log)), log, prefix=EVAL_PREFIX, write=write)
    return TokenStream(segments)


def _documents(corpus: Corpus, tokenizer: TextTokenizer | None, vocab_size: int, cache_dir: Path | None,
               texts: Callable[[], list[str]], log, prefix: str = TOKEN_PREFIX,
               write: bool = True) -> tuple[list[np.ndarray], np.ndarray]:
    """(segments, lengths) of the corpus's documents in file order: a text corpus as one array of every document's
    tokens (`_tokenized_corpus`), a token corpus as its files, each checked against the vocabulary."""
    if corpus.kind == "text":
        tokens, lengths = _tokenized_corpus(corpus, tokenizer, cache_dir, texts, log, prefix, write)
        return [tokens], lengths
    files = [_checked_tokens(path, corpus_lib.read_token_file(path), vocab_size) for path in corpus.files]
    lengths = np.array([len(f) for f in files], dtype=np.int64)
    if not lengths.sum():
        raise DataError(f"{corpus.name} holds no tokens (all {len(files)} files are empty); give a corpus "
                        "with tokens in it.")
    return files, lengths


def _read_texts(corpus: Corpus, log: Callable[[str], None]) -> list[str]:
    texts = list(corpus_lib.iter_documents(corpus))
    if not texts:
        raise DataError(f"{corpus.name} holds no text (its {len(corpus.files)} file(s) are empty or were skipped); "
                        "give a corpus with text in it.")
    log(f"dropless: read {len(texts):,} documents ({sum(map(len, texts)) / 1e6:.1f}M characters) from {corpus.name}")
    return texts


def _tokenizer(data_cfg: DataConfig, corpus: Corpus, vocab_size: int, run_dir, cache_dir: Path | None,
               texts: Callable[[], list[str]], log, resume: bool = False) -> TextTokenizer | None:
    """The run's tokenizer: given, reused from the run directory, or trained (and saved there)."""
    run_file = Path(run_dir) / TOKENIZER_FILE if run_dir is not None else None
    origin_file = cache_dir / ORIGIN_FILE if cache_dir is not None else None
    if data_cfg.tokenizer:
        origin = {"tokenizer": str(Path(data_cfg.tokenizer).expanduser().resolve())}
        tokenizer = load_tokenizer(data_cfg.tokenizer, vocab_size)
    elif corpus.kind == "tokens":
        if origin_file is not None and origin_file.exists():  # a tokenizer of an earlier run that we wrote
            run_file.unlink(missing_ok=True)
            origin_file.unlink()
        return None
    else:
        # Reuse the run's tokenizer only if it was trained for this corpus and vocabulary (the same config).
        origin = {"source": data_cfg.source, "max_bytes": data_cfg.max_bytes, "vocab_size": vocab_size}
        # A resumed run's weights belong to its tokenizer, whatever the cache's record of its origin says: that may
        # be gone (a run copied without corpus/) while the data changed since, and retraining would pair the
        # weights with another tokenizer.
        if run_file is not None and resume and not run_file.is_file():
            raise DataError(f"{run_file} is missing, and the run's weights were trained with it; put it back "
                            "(from a copy of the run) or start a new run with --overwrite.")
        recorded = _read_json(origin_file)
        if run_file is not None and run_file.is_file() and (resume or recorded == origin):
            tokenizer = load_tokenizer(run_file, vocab_size)
            if recorded != origin:
                write_atomic(origin_file, json.dumps(origin).encode())
            return tokenizer
        log(f"dropless: training a byte-level BPE tokenizer of {vocab_size} tokens on {corpus.name}")
        tokenizer = train_bpe(texts(), vocab_size)
    if run_file is not None:
        tokenizer.save(run_file)
        write_atomic(origin_file, json.dumps(origin).encode())
    return tokenizer


def _tokenized_corpus(corpus: Corpus, tokenizer: TextTokenizer, cache_dir: Path | None,
                      texts: Callable[[], list[str]], log, prefix: str = TOKEN_PREFIX,
                      write: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths): every document's tokens followed by the end-of-document id, concatenated in file
    order, and each document's length; cached per (corpus, tokenizer) in `cache_dir` (with `write` False, read
    from it only)."""
    key = hashlib.sha256((corpus.fingerprint() + tokenizer.to_str()).encode()).hexdigest()[:16]
    cache_file = cache_dir / f"{prefix}-{key}.npz" if cache_dir is not None else None
    cached = _read_cache(cache_file)
    if cached is not None:
        tokens, lengths = cached
    else:
        log(f"dropless: tokenizing {corpus.name}")
        encoded = [ids for chunk in _chunks(texts(), _ENCODE_CHUNK_CHARS) for ids in tokenizer.encode_batch(chunk)]
        dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
        tokens = np.concatenate([np.append(ids, tokenizer.eos_id) for ids in encoded]).astype(dtype)
        lengths = np.array([len(ids) + 1 for ids in encoded], dtype=np.int64)
        if cache_file is not None and write:
            for stale in cache_dir.glob(f"{prefix}-*.npz"):
                stale.unlink()
            write_atomic(cache_file, _npz_bytes(tokens=tokens, lengths=lengths))
    return tokens, lengths


def _read_cache(cache_file: Path | None) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached (tokens, lengths), or None when absent or unreadable: a damaged cache is rebuilt, not fatal."""
    if cache_file is None or not cache_file.is_file():
        return None
    try:
        with np.load(cache_file) as cached:
            tokens, lengths = cached["tokens"], cached["lengths"]
    except Exception:  # numpy raises zipfile, EOF, key and value errors for a damaged .npz
        return None
    if tokens.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != len(tokens):
        return None
    return tokens, lengths


def _chunks(texts: list[str], max_chars: int) -> Iterator[list[str]]:
    """Consecutive groups of texts of about `max_chars` characters."""
    chunk, chars = [], 0
    for text in texts:
        chunk.append(text)
        chars += len(text)
        if chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _checked_tokens(path: Path, tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids of a pre-tokenized file, checked against the model's vocabulary."""
    if len(tokens) == 0:
        return tokens
    largest, smallest = int(tokens.max()), int(tokens.min())
    if smallest < 0:
        raise DataError(f"{path} holds the negative token id {smallest}; token ids must be >= 0.")
    if largest >= vocab_size:
        # One sentence for both readers: `train` may size its vocabulary, `eval` scores a model whose size is fixed.
        raise DataError(f"{path} holds token id {largest}, beyond the vocabulary of model.vocab_size={vocab_size}; "
                        f"re-tokenize it with the model's tokenizer, or for a new model set model.vocab_size="
                        f"{largest + 1} or more.")
    return tokens


def _npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _read_json(path: Path | None):
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, json.JSONDecodeError):
        return None
