"""Corpus resolution and file readers: every format, the stdlib corpus, and each user-facing error."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dropless.data import corpus as corpus_lib
from dropless.data.corpus import DataError, DataWarning, iter_documents, read_token_file, resolve


def _texts(source, max_bytes=10**9):
    return list(iter_documents(resolve(str(source), max_bytes)))


def test_txt_file_is_one_document(tmp_path):
    (tmp_path / "a.txt").write_text("héllo\nworld\n")
    assert _texts(tmp_path / "a.txt") == ["héllo\nworld\n"]


def test_jsonl_one_document_per_line_blank_lines_skipped(tmp_path):
    lines = [json.dumps({"text": "first", "id": 1}), "", json.dumps({"text": "sécond\nline"})]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    assert _texts(tmp_path / "d.jsonl") == ["first", "sécond\nline"]


def test_parquet_text_column_nulls_skipped(tmp_path):
    table = pa.table({"text": ["one", None, "three"], "other": [1, 2, 3]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)  # two row groups: batches are chained
    assert _texts(tmp_path / "d.parquet") == ["one", "three"]


def test_directory_is_recursive_sorted_and_ignores_other_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("B")
    (tmp_path / "sub" / "a.txt").write_text("A")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "notes.md").write_text("ignored")
    (tmp_path / ".hidden.txt").write_text("ignored")
    corpus = resolve(str(tmp_path), 10**9)
    assert [p.relative_to(tmp_path).as_posix() for p in corpus.files] == ["a.txt", "b.txt", "sub/a.txt"]
    assert corpus.kind == "text"
    assert list(iter_documents(corpus)) == ["first", "B", "A"]


def test_glob_selects_matching_files(tmp_path):
    for name in ("x1.txt", "x2.txt", "y.txt"):
        (tmp_path / name).write_text(name)
    assert _texts(tmp_path / "x*.txt") == ["x1.txt", "x2.txt"]


def test_npy_any_integer_dtype_is_flattened_and_memory_mapped(tmp_path):
    tokens = np.arange(12, dtype=np.int64).reshape(3, 4)
    np.save(tmp_path / "t.npy", tokens)
    corpus = resolve(str(tmp_path / "t.npy"), 10**9)
    assert corpus.kind == "tokens"
    loaded = read_token_file(corpus.files[0])
    assert isinstance(loaded, np.memmap)
    np.testing.assert_array_equal(loaded, tokens.reshape(-1))


def test_extensions_are_case_insensitive(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(3))
    (tmp_path / "t.npy").rename(tmp_path / "T.NPY")
    corpus = resolve(str(tmp_path), 10**9)
    assert corpus.kind == "tokens"
    np.testing.assert_array_equal(read_token_file(corpus.files[0]), np.arange(3))


def test_bin_raw_uint16_little_endian(tmp_path):
    tokens = np.array([0, 1, 65535, 300], dtype="<u2")
    tokens.tofile(tmp_path / "t.bin")
    np.testing.assert_array_equal(read_token_file(tmp_path / "t.bin"), tokens)


@pytest.mark.parametrize("version,dtype", [(1, "<u2"), (2, "<u4")])
def test_bin_llmc_header(tmp_path, version, dtype):
    tokens = np.array([5, 70000 if version == 2 else 7, 9], dtype=dtype)
    header = np.zeros(256, dtype="<i4")
    header[:3] = [corpus_lib.LLMC_MAGIC, version, len(tokens)]
    (tmp_path / "t.bin").write_bytes(header.tobytes() + tokens.tobytes())
    loaded = read_token_file(tmp_path / "t.bin")
    assert loaded.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(loaded, tokens)


def test_stdlib_corpus_is_sorted_python_source_without_tests():
    corpus = resolve("stdlib", 10**9)
    root = corpus_lib.stdlib_dir()
    relative = [p.relative_to(root).as_posix() for p in corpus.files]
    assert relative == sorted(relative)
    assert all(name.endswith(".py") for name in relative)
    assert "os.py" in relative and "json/decoder.py" in relative
    skipped = corpus_lib.STDLIB_SKIPPED_DIRS
    assert not any(set(name.split("/")[:-1]) & skipped for name in relative)


def test_stdlib_corpus_is_capped_at_max_bytes_exactly():
    texts = list(iter_documents(resolve("stdlib", 50_000)))
    size = sum(len(t.encode("utf-8")) for t in texts)
    assert 50_000 - 4 <= size <= 50_000  # the cut may drop one split multi-byte character
    first = corpus_lib.stdlib_files()[0].read_text()
    assert texts[0] == first or texts[0] == first[:len(texts[0])]


def test_fingerprint_changes_when_a_file_changes(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    before = resolve(str(tmp_path), 10**9).fingerprint()
    assert resolve(str(tmp_path), 10**9).fingerprint() == before
    (tmp_path / "a.txt").write_text("three")
    os.utime(tmp_path / "a.txt", ns=(1, 1))
    assert resolve(str(tmp_path), 10**9).fingerprint() != before


# -------------------------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match=r"data.source '.*nope.txt' does not exist; give an existing file"):
        resolve(str(tmp_path / "nope.txt"), 10**9)


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(DataError, match="is a glob that matches no files"):
        resolve(str(tmp_path / "*.jsonl"), 10**9)


def test_unsupported_extension(tmp_path):
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(DataError, match=r"unsupported extension '.csv'; data files must be .txt, .jsonl"):
        resolve(str(tmp_path / "data.csv"), 10**9)
    with pytest.raises(DataError, match="unsupported extension"):  # a glob selects files explicitly too
        resolve(str(tmp_path / "data.*"), 10**9)


def test_directory_without_data_files(tmp_path):
    (tmp_path / "readme.md").write_text("x")
    with pytest.raises(DataError, match=r"holds no .txt, .jsonl, .parquet, .npy, .bin files"):
        resolve(str(tmp_path), 10**9)


def test_mixed_text_and_tokens(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    np.save(tmp_path / "b.npy", np.arange(3))
    with pytest.raises(DataError, match="mixes text files .* with token arrays"):
        resolve(str(tmp_path), 10**9)


def test_undecodable_file_is_skipped_with_a_warning(tmp_path):
    (tmp_path / "a.txt").write_text("good")
    (tmp_path / "b.txt").write_bytes(b"ok \xff\xfe bad")
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "\xff"}\n')
    with pytest.warns(DataWarning) as caught:
        assert _texts(tmp_path) == ["good"]
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "b.txt: it is not valid UTF-8 (byte 0xff at offset 3)" in messages[0]
    assert "c.jsonl: it is not valid UTF-8" in messages[1]


def test_jsonl_line_without_text(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(DataError, match=r"Line 2 of .*d.jsonl has no 'text' field"):
        _texts(tmp_path / "d.jsonl")


def test_jsonl_invalid_json_and_non_string_text(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"\n')
    with pytest.raises(DataError, match=r"Line 1 of .*d.jsonl is not valid JSON"):
        _texts(tmp_path / "d.jsonl")
    (tmp_path / "d.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(DataError, match="has a 'text' field of type int; it must be a string"):
        _texts(tmp_path / "d.jsonl")


def test_parquet_without_text_column(tmp_path):
    pq.write_table(pa.table({"content": ["a"], "id": [1]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"has no 'text' column \(its columns are content, id\)"):
        _texts(tmp_path / "d.parquet")


def test_parquet_unreadable_and_non_string_column(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="is not a readable Parquet file"):
        _texts(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "int.parquet")
    with pytest.raises(DataError, match="'text' column of .* has type int64; it must hold strings"):
        _texts(tmp_path / "int.parquet")


def test_npy_of_floats(tmp_path):
    np.save(tmp_path / "t.npy", np.ones(4, np.float32))
    with pytest.raises(DataError, match="holds float32 values; token arrays must hold integers"):
        read_token_file(tmp_path / "t.npy")


def test_bin_odd_size_and_truncated_llmc(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"odd number of bytes \(3\)"):
        read_token_file(tmp_path / "odd.bin")
    header = np.zeros(256, dtype="<i4")
    header[:3] = [corpus_lib.LLMC_MAGIC, 1, 10]
    (tmp_path / "short.bin").write_bytes(header.tobytes() + np.arange(4, dtype="<u2").tobytes())
    with pytest.raises(DataError, match="llm.c header announcing 10 tokens but holds 4"):
        read_token_file(tmp_path / "short.bin")


def test_llmc_file_longer_than_its_header_announces(tmp_path):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [corpus_lib.LLMC_MAGIC, 1, 4]
    (tmp_path / "long.bin").write_bytes(header.tobytes() + np.arange(10, dtype="<u2").tobytes())
    with pytest.raises(DataError, match="llm.c header announcing 4 tokens but holds 10"):
        read_token_file(tmp_path / "long.bin")


def test_llmc_header_of_an_unknown_version(tmp_path):
    # llm.c's magic with a version it never wrote is named as such, not read as raw uint16 ids (the magic's own
    # halves would then be token 53960 "beyond the vocabulary").
    header = np.zeros(256, dtype="<i4")
    header[:3] = [corpus_lib.LLMC_MAGIC, 3, 4]
    (tmp_path / "v3.bin").write_bytes(header.tobytes() + np.arange(4, dtype="<u2").tobytes())
    with pytest.raises(DataError, match="llm.c header of version 3") as info:
        read_token_file(tmp_path / "v3.bin")
    assert "\n" not in str(info.value) and "beyond the vocabulary" not in str(info.value)


def test_errors_are_value_errors_and_one_sentence(tmp_path):
    with pytest.raises(ValueError) as info:
        resolve(str(tmp_path / "missing"), 10**9)
    message = str(info.value)
    assert "\n" not in message and message.endswith(".") and message.count(". ") == 0


def test_npy_empty_foreign_or_a_directory(tmp_path):
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(DataError, match="empty.npy is empty; save the token ids"):
        read_token_file(tmp_path / "empty.npy")
    (tmp_path / "text.npy").write_text("1 2 3")
    with pytest.raises(DataError, match="text.npy is not an .npy file"):
        read_token_file(tmp_path / "text.npy")
    np.save(tmp_path / "t.npy", np.arange(10, dtype=np.int32))
    (tmp_path / "torn.npy").write_bytes((tmp_path / "t.npy").read_bytes()[:140])
    with pytest.raises(DataError, match="torn.npy is not a readable .npy array"):
        read_token_file(tmp_path / "torn.npy")
    (tmp_path / "dir.npy").mkdir()
    with pytest.raises(DataError, match="dir.npy is a directory"):
        corpus_lib.load_token_array(tmp_path / "dir.npy")
