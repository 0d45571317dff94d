"""The byte-level BPE tokenizer: training, round trip, saving, loading and its errors."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from dropless.data import EOS_TOKEN, DataError, load_tokenizer, train_bpe
from dropless.data.tokenizer import LONGEST_WORD, training_pieces

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "for i in range(10):\n    print(i, i * i)\n",
] * 4


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(CORPUS, 300)


def test_trained_vocabulary_and_end_of_document_token(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_id == 0
    assert 257 < tokenizer.vocab_size <= 300  # 256 bytes + EOS, plus some merges
    assert tokenizer.hf.get_vocab_size() == tokenizer.vocab_size


@pytest.mark.parametrize("text", ["def add(a, b):\n    return a + b\n", "unseen wörds ✓ \t\r\n 漢字 🙂", ""])
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32
    assert tokenizer.decode(ids) == text
    if text:
        assert ids.min() >= 0 and ids.max() < tokenizer.vocab_size


def test_merges_compress_training_text(tokenizer):
    text = CORPUS[2]
    assert len(tokenizer.encode(text)) < len(text.encode("utf-8")) / 2


def test_eos_text_is_not_a_special_token_when_encoding(tokenizer):
    # Documents are separated by the id we append, never by text that happens to spell the token.
    assert 0 not in tokenizer.encode(f"a {EOS_TOKEN} b").tolist()


def test_encode_batch_matches_encode(tokenizer):
    batch = tokenizer.encode_batch(CORPUS[:4])
    for text, ids in zip(CORPUS[:4], batch):
        np.testing.assert_array_equal(ids, tokenizer.encode(text))


def test_save_and_load_give_the_same_tokenizer(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json", vocab_size=300)
    assert loaded.to_str() == tokenizer.to_str()
    np.testing.assert_array_equal(loaded.encode(CORPUS[1]), tokenizer.encode(CORPUS[1]))
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temporary file left behind


def test_training_is_deterministic(tokenizer):
    assert train_bpe(CORPUS, 300).to_str() == tokenizer.to_str()


def test_loaded_tokenizer_finds_another_end_of_document_token(tmp_path):
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.add_tokens(list("abc"))
    hf.add_special_tokens(["</s>"])
    hf.save(str(tmp_path / "t.json"))
    loaded = load_tokenizer(tmp_path / "t.json")
    assert loaded.eos_token == "</s>" and loaded.eos_id == 3 and loaded.vocab_size == 4
    # Several candidates: the first in the documented order (docs/data.md), whatever their ids.
    candidates = ["<|im_end|>", "<eos>", "</s>", "<|end_of_text|>"]
    for held in (candidates, candidates[:3], candidates[:2]):
        hf = Tokenizer(models.BPE())
        hf.add_special_tokens(held)
        hf.save(str(tmp_path / "several.json"))
        assert load_tokenizer(tmp_path / "several.json").eos_token == held[-1], held


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(DataError, match=r"The tokenizer file .*nope.json does not exist; give the path"):
        load_tokenizer(tmp_path / "nope.json")


def test_invalid_tokenizer_file(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(DataError, match=r"t.json is not a valid tokenizer.json \(.+\); give a file saved by"):
        load_tokenizer(tmp_path / "t.json")
    (tmp_path / "t.json").write_text("{truncated")
    with pytest.raises(DataError, match="is not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "t.json")


def test_tokenizer_larger_than_the_model_vocabulary(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "t.json")
    size = tokenizer.vocab_size
    with pytest.raises(DataError, match=f"has {size} tokens but model.vocab_size=260; use the model's own tokenizer .* set model.vocab_size={size} "):
        load_tokenizer(tmp_path / "t.json", vocab_size=260)


def test_tokenizer_without_end_of_document_token(tmp_path):
    hf = Tokenizer(models.BPE())
    hf.add_tokens(list("abc"))
    hf.save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match=r"has no end-of-document token \(one of <\|endoftext\|>"):
        load_tokenizer(tmp_path / "t.json")


def test_deepseek_v3s_end_of_sentence_token_ends_its_documents(tmp_path):
    """DeepSeek-V3's tokenizer.json has none of the other tokenizers' end tokens: fine-tuning from its checkpoint
    needs its own."""
    hf = Tokenizer(models.BPE())
    hf.add_tokens(list("abc"))
    hf.add_special_tokens(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"])
    hf.save(str(tmp_path / "t.json"))
    loaded = load_tokenizer(tmp_path / "t.json")
    assert (loaded.eos_token, loaded.eos_id) == ("<｜end▁of▁sentence｜>", 4)


def test_vocabulary_too_small_for_bytes():
    with pytest.raises(DataError, match="model.vocab_size=200 is too small for a byte-level BPE tokenizer"):
        train_bpe(CORPUS, 200)


def test_vocabulary_of_exactly_the_bytes_lacks_room_for_the_end_of_document_token():
    with pytest.raises(DataError, match="model.vocab_size=256 is too small"):
        train_bpe(CORPUS, 256)
    assert train_bpe(CORPUS, 257).vocab_size == 257


def test_a_directory_given_as_tokenizer(tmp_path):
    with pytest.raises(DataError, match="is a directory; give the path of a tokenizer.json file"):
        load_tokenizer(tmp_path)


def test_a_run_of_non_space_characters_reaches_the_trainer_in_words_of_bounded_length():
    """BPE training slows with the square of a word's length (a 3 MB line without spaces stalls it for hours):
    longer runs reach it in pieces of at most LONGEST_WORD characters, and shorter text as it is."""
    text = "ab " + "x" * 600 + " 12" + "9" * 300 + "\n" + "y" * LONGEST_WORD
    pieces = list(training_pieces(text))
    assert "".join(pieces) == text and len(pieces) == 4, [len(p) for p in pieces]
    words = [word for piece in pieces for word in piece.replace("\n", " ").split(" ")]
    assert max(map(len, words)) == LONGEST_WORD
    assert list(training_pieces(CORPUS[1])) == [CORPUS[1]] and list(training_pieces("")) == [""]
    tokenizer = train_bpe(CORPUS + ["q" * 5000], 600)  # one word of 5,000 would merge up to 2,048 q's
    assert max(len(token) for token in tokenizer.hf.get_vocab()) == LONGEST_WORD
    text = "head " + "q" * 3000 + " tail"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_vocabulary_with_gaps_in_its_ids_needs_the_largest_id_plus_one(tmp_path):
    """A tokenizer.json whose ids skip some numbers: the model's embedding must hold its largest id, not merely as
    many rows as it has tokens; a model vocabulary of exactly that size is enough, one less is refused."""
    hf = Tokenizer(models.BPE(vocab={"a": 0, "b": 5}, merges=[]))
    hf.add_special_tokens(["</s>"])
    hf.save(str(tmp_path / "t.json"))
    loaded = load_tokenizer(tmp_path / "t.json", vocab_size=6)  # 3 tokens, ids 0, 2 and 5
    assert (loaded.eos_id, loaded.vocab_size) == (2, 6)
    with pytest.raises(DataError, match="has 6 tokens but model.vocab_size=5; .* set model.vocab_size=6 "):
        load_tokenizer(tmp_path / "t.json", vocab_size=5)


def test_decoding_keeps_the_end_of_document_token(tokenizer):
    """Generated text shows where a document ended: decode spells the end token out rather than dropping it."""
    ids = np.concatenate([tokenizer.encode("ab"), [tokenizer.eos_id], tokenizer.encode("cd")])
    assert tokenizer.decode(ids) == f"ab{EOS_TOKEN}cd"
