"""`--overwrite` keeps the run it replaces until the new run has its first checkpoint (dropless.train.overwrite): a
data error or a setting the step cannot take puts it back whole, tokenizer included, and a process killed at any point of setting it aside, putting it
back or discarding it leaves a state that the next start in the directory finishes undoing."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from dropless.core import config as config_lib
from dropless.train import checkpoint as ckpt
from dropless.train import loop
from dropless.train import overwrite as overwrite_lib
from dropless.train.loop import train
from tests.test_train import SMALL, corpus, small_config  # noqa: F401 (corpus is a fixture)
from tests.test_train_parallel import run_processes


def fake_run(run_dir: Path, config, tokenizer: bool = True, imported: bool = False) -> dict[str, bytes]:
    """A run directory's files as a trained run leaves them (their contents stand in): {relative path: bytes}.
    `tokenizer`: the run has one (trained on text; none on tokens). `imported`: also the mark `dropless convert
    --from-hf` leaves (such a run is never resumed, only replaced)."""
    files = {"config.json": None, "metrics.jsonl": b'{"step": 1}\n', "router.json": b"{}", "router.bin": b"\0" * 8,
             "checkpoints/10/model/data": b"weights", "checkpoints/10/optimizer/data": b"optimizer state",
             "tensorboard/events": b"events",
             "checkpoints.damaged/5/model/data": b"damaged", "corpus/tokens-0123.npz": b"the old run's tokens"}
    if imported:
        files["hf_source.json"] = b"{}"
    if tokenizer:
        files |= {"tokenizer.json": b"the old run's tokenizer", "corpus/tokenizer-origin.json": b'{"source": "old"}'}
    for name, data in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        if name == "config.json":
            config_lib.save(config, run_dir / name)
        else:
            (run_dir / name).write_bytes(data)
    return files_of(run_dir)


def files_of(run_dir: Path) -> dict[str, bytes]:
    """Every file under `run_dir` but the OS lock: {relative path: bytes}."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*")
            if p.is_file() and p.name != ".lock"}


def test_an_overwrite_whose_data_is_wrong_keeps_the_run_it_would_have_replaced(tmp_path, corpus):
    """`--overwrite --data TYPO`: the old run's files wait aside until the new run has a checkpoint, so the data
    error leaves them as they were, and so does a setting the step cannot take here (found after the data loads);
    an overwrite whose run reaches a checkpoint deletes them (the tokenizer stays for the loader to check against
    the new data)."""
    run_dir = tmp_path / "run"
    before = fake_run(run_dir, small_config(corpus), imported=True)
    wrong = small_config(corpus, **{"data.source": str(tmp_path / "no-such-data")})
    with pytest.raises(Exception, match="does not exist"):
        train(wrong, run_dir, overwrite=True, progress=False, log=lambda s: None)
    assert files_of(run_dir) == before
    on_gpu_only = small_config(corpus, **{"moe.gmm_backend": "dropless_mosaic"})
    with pytest.raises(Exception, match="needs an NVIDIA GPU"):
        train(on_gpu_only, run_dir, overwrite=True, progress=False, log=lambda s: None)
    assert files_of(run_dir) == before
    loop.prepare_run_dir(run_dir, small_config(corpus), resume=False, overwrite=True)
    overwrite_lib.discard(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.json", "corpus", "tokenizer.json"]


def test_an_overwrite_whose_data_fails_after_its_tokenizer_keeps_the_old_run_s_tokenizer(tmp_path, corpus):
    """A corpus too small for one training and one held-out sequence fails after its tokenizer was trained and
    saved over the run's, and its tokens cached in place of the run's: the run put back reads with its own
    tokenizer and tokens, not the failed run's."""
    run_dir = tmp_path / "run"
    before = fake_run(run_dir, small_config(corpus), imported=True)
    small = tmp_path / "small"
    small.mkdir()
    (small / "doc.txt").write_text("a few words")
    logged = []
    with pytest.raises(Exception, match="needs at least"):
        train(small_config(corpus, **{"data.source": str(small)}), run_dir, overwrite=True, progress=False,
              log=logged.append)
    assert any("training a byte-level BPE" in line for line in logged)  # it failed after its tokenizer
    assert any("tokenizing" in line for line in logged)  # and after its token cache
    assert files_of(run_dir) == before


def test_an_overwrite_that_another_process_cannot_follow_keeps_the_run_it_would_have_replaced(tmp_path, corpus):
    """Two processes of the real CLI, process 1 given a run directory of its own (as on a host that does not share
    the filesystem): process 0 has set the old run aside and loaded the new data, process 1 cannot read the run,
    and the agreement that follows puts the old run back before anything is deleted; each process ends with one
    line and status 2."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    before = fake_run(run_dir, small_config(corpus), imported=True)
    command = [sys.executable, "-m", "dropless.cli", "train", "--data", str(corpus), "--overwrite", "--no-progress",
               *(f"{k}={v}" for k, v in SMALL.items()), "--run-dir"]
    results = run_processes([[*command, str(run_dir)], [*command, str(elsewhere)]])
    errors = [[line for line in stderr.splitlines() if line.startswith("dropless: error")]
              for _, _, stderr in results]
    assert [status for status, _, _ in results] == [2, 2], [stderr[-3000:] for _, _, stderr in results]
    assert errors[0] == ["dropless: error: process 1 of 2 could not load the run's data (its own error line says "
                         "why); the run that --overwrite set aside is put back."]
    assert errors[1] == [f"dropless: error: process 1 finds no config.json in {elsewhere}, which process 0 has just "
                         "written: every process must see the same run directory; put --run-dir on a filesystem "
                         "that all hosts share."]
    assert all("Traceback" not in stderr for _, _, stderr in results)
    assert files_of(run_dir) == before


def test_a_disk_full_while_setting_the_old_run_aside_leaves_it_in_place(tmp_path, corpus, monkeypatch, capsys):
    """`--overwrite` on a disk that fills while the old run's tokenizer is copied aside (half the file written):
    one line naming the run directory and the full disk, status 2, and the old run as it was, nothing aside."""
    import errno

    from dropless.cli import main

    run_dir = tmp_path / "run"
    before = fake_run(run_dir, small_config(corpus), imported=True)

    def disk_full(source, target, **kwargs):
        Path(target).write_bytes(Path(source).read_bytes()[:4])
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr(shutil, "copy2", disk_full)
    assert main(["train", "--data", str(corpus), "--run-dir", str(run_dir), "--overwrite", "--no-progress",
                 *(f"{k}={v}" for k, v in SMALL.items())]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"dropless: error: {run_dir}: no space left on device; free some space or choose another location.")
    assert files_of(run_dir) == before


def test_a_resume_after_an_interrupted_overwrite_reads_the_run_s_own_tokenizer(tmp_path, corpus):
    """Killed while its data loaded, an overwrite leaves the old run aside; `--resume` then puts it back and reads
    its tokenizer as it is, although no origin record says which data it was trained on (a run copied without
    corpus/): the weights were trained with it."""
    from dropless.data.tokenizer import train_bpe

    config = small_config(corpus)
    run_dir = tmp_path / "run"
    fake_run(run_dir, config, tokenizer=False)
    train_bpe(["another text altogether, " * 50], config.model.vocab_size).save(run_dir / "tokenizer.json")
    before = (run_dir / "tokenizer.json").read_bytes()
    overwrite_lib.set_aside(run_dir)
    new_run_starts(run_dir, small_config(corpus, **{"train.steps": 7}))
    logged = []
    loop._open_run(config, run_dir, True, resume=True, overwrite=False, log=logged.append, new=False)
    assert (run_dir / "tokenizer.json").read_bytes() == before
    assert not any("training a byte-level BPE" in line for line in logged), logged


def test_a_trained_run_beside_a_set_aside_one_is_kept(tmp_path, corpus):
    """A `.replaced` beside a run that has reached a checkpoint is not what an interrupted overwrite leaves (its
    new run discards the old before training); the next start keeps the trained run and deletes the other."""
    run_dir = tmp_path / "run"
    fake_run(run_dir, small_config(corpus))
    overwrite_lib.set_aside(run_dir)
    trained = {name: data for name, data in fake_run(run_dir, small_config(corpus, **{"train.steps": 7})).items()
               if not name.startswith(".replaced/")}
    logged = []
    overwrite_lib.recover(run_dir, logged.append)
    assert files_of(run_dir) == trained and not (run_dir / ".replaced").exists() and not logged


class Killed(BaseException):
    """The process dies here: nothing after it runs, no handler sees it."""


def partly(name: str, *args) -> None:
    """What a change does before a kill in its middle: a deletion has deleted one file, a copy written half."""
    if name == "rmtree" and Path(args[0]).is_dir():
        first = next((p for p in sorted(Path(args[0]).rglob("*")) if p.is_file()), None)
        if first is not None:
            os.unlink(first)  # not Path.unlink: that one is counted
    elif name == "copy2":
        Path(args[1]).write_bytes(Path(args[0]).read_bytes()[:4])


def kill_at(monkeypatch, n: int | None) -> list[str]:
    """Count the filesystem changes dropless.train.overwrite makes and die in the n-th (None: never), after
    `partly`; returns the list of the changes made."""
    made: list[str] = []

    def counted(name, original):
        def wrapper(*args, **kwargs):
            if len(made) == n:
                partly(name, *args)
                raise Killed(name)
            made.append(name)
            return original(*args, **kwargs)
        return wrapper

    for owner, name in ((Path, "rename"), (Path, "mkdir"), (Path, "unlink"), (shutil, "rmtree"), (shutil, "copy2")):
        monkeypatch.setattr(owner, name, counted(name, getattr(owner, name)))
    return made


def new_run_starts(run_dir: Path, config) -> None:
    """What an overwriting run writes before its first checkpoint: its config, a tokenizer trained over the old, and
    its tokens in place of the old run's."""
    config_lib.save(config, run_dir / "config.json")
    (run_dir / "tokenizer.json").write_bytes(b"the new run's tokenizer")
    (run_dir / "corpus" / "tokenizer-origin.json").write_bytes(b'{"source": "new"}')
    for stale in (run_dir / "corpus").glob("tokens-*.npz"):
        stale.unlink()
    (run_dir / "corpus" / "tokens-4567.npz").write_bytes(b"the new run's tokens")


STAGES = ("set aside", "put back", "discard")


def _interrupted(tmp_path: Path, monkeypatch, stage: str, n: int | None, old, new,
                 tokenizer: bool) -> tuple[Path, list[str]]:
    run_dir = tmp_path / f"{stage}-{n}"
    fake_run(run_dir, old, tokenizer)
    if stage != "set aside":
        overwrite_lib.set_aside(run_dir)
        new_run_starts(run_dir, new)
    made = kill_at(monkeypatch, n)
    try:
        {"set aside": overwrite_lib.set_aside, "put back": overwrite_lib.put_back,
         "discard": overwrite_lib.discard}[stage](run_dir)
    except Killed:
        pass
    monkeypatch.undo()
    return run_dir, made


@pytest.mark.parametrize("tokenizer", [True, False], ids=["text", "tokens"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_kill_at_any_point_of_an_overwrite_is_undone_by_the_next_start(tmp_path, monkeypatch, corpus, stage,
                                                                         tokenizer):
    """Killed in each of the filesystem changes of setting the old run aside, of putting it back after a data
    error, or of discarding it once the new run has a checkpoint, for an old run with a tokenizer and one without
    (whose new run trained one): the next start in the directory finds the old run
    whole where the new one never trained, and the new run's files, nothing of the old, where `.replaced` was gone."""
    old, new = small_config(corpus), small_config(corpus, **{"train.steps": 7})
    reference = fake_run(tmp_path / "reference", old, tokenizer)
    _, made = _interrupted(tmp_path, monkeypatch, stage, None, old, new, tokenizer)
    assert made
    for n in range(len(made)):
        run_dir, _ = _interrupted(tmp_path, monkeypatch, stage, n, old, new, tokenizer)
        interrupted = any(p.name.startswith(".") for p in run_dir.iterdir())
        logged = []
        overwrite_lib.recover(run_dir, logged.append)
        left = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("."))
        assert left == [], (stage, n, left)
        if stage == "discard" and n > 0:  # the new run had its data, and `.replaced` was gone in one rename
            assert config_lib.load(run_dir / "config.json").train.steps == 7, (stage, n)
            assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists(), (stage, n)
        else:  # a kill before that rename: the new run had not trained, and the old comes back
            assert files_of(run_dir) == reference, (stage, n)
        assert len(logged) == (interrupted and not (stage == "discard" and n > 0)), (stage, n, logged)


def test_the_next_start_resumes_the_run_an_interrupted_overwrite_set_aside(tmp_path, corpus):
    """Killed after setting the old run aside and writing its own config, before its data loaded: `--resume` then
    continues the old run, with one line saying so."""
    old = small_config(corpus)
    run_dir = tmp_path / "run"
    before = fake_run(run_dir, old)
    overwrite_lib.set_aside(run_dir)
    new_run_starts(run_dir, small_config(corpus, **{"train.steps": 7}))
    logged = []
    assert loop.prepare_run_dir(run_dir, old, resume=True, overwrite=False, log=logged.append).train.steps == 300
    assert {k: v for k, v in files_of(run_dir).items() if k != "config.json"} == \
           {k: v for k, v in before.items() if k != "config.json"}  # config.json: the resolved schedule horizon
    assert len(logged) == 1 and "back in place" in logged[0]


@pytest.mark.parametrize("stage", STAGES)
def test_before_the_next_start_an_interrupted_overwrite_s_run_is_read_as_the_one_it_will_leave(tmp_path, monkeypatch,
                                                                                              corpus, stage):
    """Killed anywhere in setting the old run aside, putting it back or discarding it: before the next start
    recovers, `run_config_path` (what `train --resume` builds its config from) names the config.json that recovery
    will leave in place (none where it leaves none), and `reaches_a_checkpoint` answers for the run it will leave,
    wherever its files stand: in place, in `.replacing`, `.replaced` or `.restoring`."""
    old, new = small_config(corpus), small_config(corpus, **{"train.steps": 7})
    _, made = _interrupted(tmp_path, monkeypatch, stage, None, old, new, True)
    for n in range(len(made)):
        run_dir, _ = _interrupted(tmp_path, monkeypatch, stage, n, old, new, True)
        config_path, reaches = overwrite_lib.run_config_path(run_dir), overwrite_lib.reaches_a_checkpoint(run_dir)
        steps = config_lib.load(config_path).train.steps if config_path.is_file() else None
        overwrite_lib.recover(run_dir, lambda line: None)
        left = run_dir / "config.json"
        assert steps == (config_lib.load(left).train.steps if left.is_file() else None), (stage, n, config_path)
        assert reaches == ckpt.reached_a_checkpoint(run_dir), (stage, n)


def test_a_trained_run_beside_a_set_aside_one_is_the_run_read(tmp_path, corpus):
    """A `.replaced` beside a run that reached a checkpoint is deleted by the next start: `train --resume` builds its
    config from the trained run's config.json, not from the one set aside."""
    run_dir = tmp_path / "run"
    fake_run(run_dir, small_config(corpus))
    overwrite_lib.set_aside(run_dir)
    fake_run(run_dir, small_config(corpus, **{"train.steps": 7}))
    assert overwrite_lib.run_config_path(run_dir) == run_dir / "config.json"
    assert config_lib.load(overwrite_lib.run_config_path(run_dir)).train.steps == 7
