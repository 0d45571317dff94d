"""Tokenizers: a byte-level BPE trained on the corpus (HF `tokenizers`), or a given `tokenizer.json`.

Byte-level BPE (GPT-2's scheme) encodes any text without unknown tokens: the 256 bytes are the base
alphabet and `<|endoftext|>` (id 0) separates documents.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dropless.core.files import write_atomic
from dropless.data.corpus import DataError

EOS_TOKEN = "<|endoftext|>"
TRAINED_EOS_ID = 0  # EOS_TOKEN's id in a tokenizer `train_bpe` trains: its one special token comes first
# End-of-document tokens of common tokenizers, tried in order when a tokenizer.json is loaded (GPT-2 and Qwen,
# Llama 3, Mistral and Mixtral, Gemma, ChatML, DeepSeek-V3's, spelled with full-width bars and U+2581).
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<｜end▁of▁sentence｜>")
BYTE_ALPHABET_SIZE = 256


def eos_token(tokenizer: Tokenizer) -> str | None:
    """The token that ends each document in training: the first of EOS_CANDIDATES the tokenizer has (None if none)."""
    return next((t for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)


class TextTokenizer:
    """A HF `tokenizers.Tokenizer` with its end-of-document id; encodes to numpy token arrays."""

    def __init__(self, tokenizer: Tokenizer, name: str = "the tokenizer"):
        self.hf = tokenizer
        # Text that merely spells a special token ("<|endoftext|>" in a document) is encoded as text:
        # documents are separated only by the id the loader appends.
        self.hf.encode_special_tokens = True
        # Ids may have gaps, so the vocabulary the model needs is the largest id plus one.
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        eos = eos_token(tokenizer)
        if eos is None:
            raise DataError(f"{name} has no end-of-document token (one of {', '.join(EOS_CANDIDATES)}); "
                            "add one as a special token, or omit --tokenizer to train one.")
        self.eos_token = eos
        self.eos_id = tokenizer.token_to_id(eos)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (no special tokens added), int32."""
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encode many documents at once (parallel in Rust)."""
        return [np.asarray(e.ids, dtype=np.int32) for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_str(self) -> str:
        return self.hf.to_str()

    def save(self, path: Path) -> None:
        """Write tokenizer.json atomically (a crash never leaves a half-written file)."""
        write_atomic(path, self.hf.to_str(pretty=True))


# The longest run of non-space characters the BPE trainer sees as one word. Its time grows faster than the square
# of a word's length (one line of 320,000 letters takes a minute and a half, a 3 MB one hours), so a minified file or
# a long digit string in a corpus would stall `dropless train` without a word; longer runs reach the trainer in
# pieces of this length. Ordinary text has no such runs and trains as it is, and encoding is unchanged: it handles
# long words in about linear time.
LONGEST_WORD = 256
_LONG_RUN = re.compile(rf"\S{{{LONGEST_WORD + 1},}}")


def training_pieces(text: str) -> Iterator[str]:
    """`text` cut at every LONGEST_WORD characters of each longer run of non-space characters: the pieces the
    trainer counts words in, each one a text of its own (so a cut never joins two pieces into one word)."""
    start = 0
    for run in _LONG_RUN.finditer(text):
        for cut in range(run.start() + LONGEST_WORD, run.end(), LONGEST_WORD):
            yield text[start:cut]
            start = cut
    yield text[start:]


def train_bpe(texts: Iterable[str], vocab_size: int) -> TextTokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens (fewer if the text runs out of pairs)."""
    if vocab_size < BYTE_ALPHABET_SIZE + 1:
        raise DataError(f"model.vocab_size={vocab_size} is too small for a byte-level BPE tokenizer, which needs "
                        f"at least {BYTE_ALPHABET_SIZE + 1} tokens (256 bytes and {EOS_TOKEN}); raise it.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((piece for text in texts for piece in training_pieces(text)), trainer)
    return TextTokenizer(tokenizer, "the trained tokenizer")


def read_tokenizer_file(path: Path) -> Tokenizer:
    """A Hugging Face `Tokenizer` from a tokenizer.json; a file it cannot parse raises DataError naming it."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory; give the path of a tokenizer.json file.")
    if path.exists() and not path.is_file():
        raise DataError(f"{path} is not a regular file (a pipe or a device); give the path of a tokenizer.json.")
    if not path.is_file():
        raise DataError(f"The tokenizer file {path} does not exist; give the path of a tokenizer.json.")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for every parse error
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{path} is not a valid tokenizer.json ({reason}); give a file saved by Hugging Face "
                        "tokenizers.") from e


def load_tokenizer(path: str | Path, vocab_size: int | None = None) -> TextTokenizer:
    """Load a `tokenizer.json`; with `vocab_size`, check that its ids fit in the model's vocabulary."""
    path = Path(os.path.expanduser(str(path)))
    if not path.exists():
        raise DataError(f"The tokenizer file {path} does not exist; give the path of a tokenizer.json, or omit "
                        "--tokenizer to train one on the corpus.")
    loaded = TextTokenizer(read_tokenizer_file(path), str(path))
    if vocab_size is not None and loaded.vocab_size > vocab_size:
        raise DataError(f"The tokenizer {path} has {loaded.vocab_size} tokens but model.vocab_size={vocab_size}; "
                        f"use the model's own tokenizer (or a smaller one), or for a new model set model.vocab_size="
                        f"{loaded.vocab_size} or more.")
    return loaded
