"""Files written whole or not at all (dropless.core.files): `atomic_file`, the form for contents written in parts
(`dropless logits`' arrays), on success, on a disk that fills partway, and on an error inside the block."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from dropless.core import files


def _previous(tmp_path):
    path = tmp_path / "logits.npy"
    np.save(path, np.arange(6, dtype=np.float32))
    return path


def test_atomic_file_replaces_the_file_whole(tmp_path):
    path = _previous(tmp_path)
    with files.atomic_file(path) as file:
        np.save(file, np.ones((64, 1024), np.float32))  # several of NumPy's chunks
    np.testing.assert_array_equal(np.load(path), np.ones((64, 1024), np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]


def test_a_disk_that_fills_partway_leaves_the_previous_file_and_names_the_path(tmp_path, monkeypatch):
    """The write stops after some bytes with ENOSPC, as on a full disk: the OSError names the file the user asked
    for (the CLI's one line) and carries the errno, the previous file is whole and no temporary file is left."""
    path = _previous(tmp_path)
    real_open = open

    class Filling:
        def __init__(self, name, mode):
            self.file, self.written = real_open(name, mode), 0

        def write(self, data):
            if self.written + len(data) > 1000:
                self.file.write(bytes(data)[:1000 - self.written])
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.file.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(files, "open", Filling, raising=False)
    with pytest.raises(OSError) as raised:
        with files.atomic_file(path) as file:
            np.save(file, np.ones((64, 1024), np.float32))
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(path))
    np.testing.assert_array_equal(np.load(path), np.arange(6, dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]


def test_an_error_inside_the_block_leaves_the_previous_file(tmp_path):
    path = _previous(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_file(path) as file:
            file.write(b"partial")
            raise KeyboardInterrupt
    np.testing.assert_array_equal(np.load(path), np.arange(6, dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logits.npy"]


def test_a_kill_before_write_atomic_renames_leaves_the_old_file_and_a_temporary_the_next_start_removes(tmp_path,
                                                                                                       monkeypatch):
    path = tmp_path / "router.json"
    path.write_text("old")

    class Killed(BaseException):
        pass

    def killed(*_):
        raise Killed
    monkeypatch.setattr(files.os, "replace", killed)
    with pytest.raises(Killed):
        files.write_atomic(path, "new")
    monkeypatch.undo()
    assert path.read_text() == "old"
    (tmp_path / "notes.tmp").write_text("the user's")
    files.remove_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", "router.json"]


def test_a_file_or_pipe_in_the_way_of_a_directory_is_found(tmp_path):
    assert files.file_in_the_way(tmp_path / "new" / "deeper") is None
    (tmp_path / "plain").write_text("x")
    assert files.file_in_the_way(tmp_path / "plain" / "run") == tmp_path / "plain"
    os.mkfifo(tmp_path / "pipe")
    assert files.file_in_the_way(tmp_path / "pipe" / "run") == tmp_path / "pipe"
