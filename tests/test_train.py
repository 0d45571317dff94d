"""End-to-end training: the loss falls, nothing is dropped, and a resumed run equals an uninterrupted one bit for bit."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from dropless.core import config as config_lib
from dropless.train import checkpoint as ckpt
from dropless.train import metrics as metrics_lib
from dropless.train.loop import _DropCounter, train
from dropless.train.metrics import MetricsError, MetricsWriter, keep_records_through, read_metrics

CORPUS = "\n\n".join(
    f"def function_{i}(x, y):\n    '''Add {i} to the product.'''\n    return x * y + {i}\n" for i in range(400))

# A tiny model of the tiny preset's architecture (MLA, a dense first layer, shared expert, group-limited
# sigmoid routing with the balancing bias), small enough to compile and train in seconds on a CPU.
SMALL = {
    "model.vocab_size": 320, "model.hidden_size": 32, "model.num_layers": 3, "model.num_heads": 2,
    "model.dense_intermediate_size": 64, "model.q_lora_rank": 16, "model.kv_lora_rank": 16,
    "model.qk_rope_head_dim": 8, "model.qk_nope_head_dim": 8, "model.v_head_dim": 8, "model.max_seq_len": 32,
    "moe.num_experts": 8, "moe.expert_intermediate_size": 16,
    "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 2, "train.log_every": 1,
    "train.eval_batches": 1, "train.dtype": "float32", "data.max_bytes": 200_000,
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def write_corpus(directory: Path) -> Path:
    """Forty small text documents (one per file) in `directory`."""
    chunks = CORPUS.split("\n\n")
    for i in range(40):
        (directory / f"doc{i:02d}.txt").write_text("\n\n".join(chunks[i * 10:(i + 1) * 10]))
    return directory


def small_config(corpus: Path, **overrides) -> config_lib.Config:
    return config_lib.load_preset("tiny").replace(**{**SMALL, "data.source": str(corpus), **overrides})


# The schedule and learning rate of the 40-step run below. Other tests that train a few steps of this model on
# 8 devices take them too: their step and evaluation are then its programs, which the compilation cache holds.
TRAINED_SCHEDULE = {"train.schedule_steps": 40, "train.learning_rate": 1e-2}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> tuple[config_lib.Config, Path, object]:
    """(config, run directory, summary) of one 40-step training, shared by the tests that only read it."""
    config = small_config(corpus, **{"train.steps": 40, "train.eval_every": 40, "train.checkpoint_every": 40,
                                     **TRAINED_SCHEDULE})
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    return config, run_dir, train(config, run_dir, progress=False, log=lambda s: None)


def test_training_reduces_held_out_loss_and_drops_nothing(trained):
    _, run_dir, summary = trained
    first, last = summary.eval_losses[0][1], summary.eval_losses[-1][1]
    assert last < 0.6 * first, summary.eval_losses
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert len(records) == 40
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
                "tokens_dropped", "max_expert_load"):
        assert key in records[-1], key
    assert all(r["tokens_dropped"] == 0 for r in records)
    # The router rows' health, one value per MoE layer; the logits' covariance it is read from stays off the file.
    rows = len(records[-1]["router_logit_token_share"])
    assert rows >= 1 and "router_logit_covariance" not in records[-1]
    assert len(records[-1]["router_logit_top_direction"]) == rows
    assert all(0.0 < v <= 1.0 for r in records for v in r["router_logit_top_direction"])
    assert all(0.0 <= v <= 1.0 for r in records for v in r["router_input_common_share"])
    assert len(records[-1]["router_input_common_share"]) == rows
    # The tiny preset keeps the routers' running input means: their cosine with each step's mean input.
    assert len(records[-1]["router_common_alignment"]) == rows
    assert all(-1.0 <= v <= 1.0 + 1e-6 for r in records for v in r["router_common_alignment"])
    assert records[-1]["mfu"] is None  # no known peak on a CPU
    assert (run_dir / "training.png").stat().st_size > 0
    assert list((run_dir / "tensorboard").iterdir())
    assert ckpt.latest_step(run_dir) == 40


def test_resume_is_bit_exact_and_keeps_the_schedule(tmp_path, corpus):
    # Split inside the warm-up (4 steps), where a changed schedule horizon would change the learning rate. No
    # training.png (train.plot=false) until the resumed part, which may turn it on: a resume may change it. The
    # routers' running input means (moe.router_common_rate) are state that must resume exactly too, and so is the step
    # counter: the first 4 steps take the other sequences' direction, the resumed part's first step the last of them.
    config = small_config(corpus, **{"train.steps": 6, "train.eval_every": 100, "train.checkpoint_every": 3,
                                     "train.warmup_steps": 4, "train.plot": False, "moe.router_common_rate": 0.3,
                                     "moe.router_common_source": "other_sequences", "moe.router_common_other_steps": 4})
    train(config, tmp_path / "full", progress=False, log=lambda s: None)
    # Stopped early at step 3 of a 6-step schedule (the horizon is explicit, so the first part's is 6 too), then
    # extended past it: the saved horizon holds, so steps 1-6 are the uninterrupted run's.
    train(config.replace(**{"train.steps": 3, "train.schedule_steps": 6}), tmp_path / "split", progress=False,
          log=lambda s: None)
    assert not (tmp_path / "split" / "training.png").exists() and (tmp_path / "split" / "metrics.jsonl").is_file()
    # As a kill after a later, unsaved step leaves it: a record past the checkpoint, then a torn line.
    with (tmp_path / "split" / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 4, "loss": 99.0}) + '\n{"step": 5, "lo')
    summary = train(config.replace(**{"train.steps": 8, "train.plot": True}), tmp_path / "split", resume=True,
                    progress=False, log=lambda s: None)
    assert summary.eval_losses[0][0] == 0  # the run's first evaluation, from metrics.jsonl
    assert (tmp_path / "split" / "training.png").stat().st_size > 0

    def losses(run):
        return {r["step"]: r["loss"] for r in read_metrics(tmp_path / run) if "loss" in r}

    full, split = losses("full"), losses("split")
    assert [r["step"] for r in read_metrics(tmp_path / "split") if "loss" in r] == list(range(1, 9))  # each once
    for step in range(4, 7):
        assert split[step] == full[step], (step, split[step], full[step])  # bit for bit, not approximately
    assert ckpt.load_run_config(tmp_path / "full").train.schedule_steps == 6  # 0 resolved, saved with the run
    assert ckpt.load_run_config(tmp_path / "split").train.schedule_steps == 6
    _, params_full, state_full = ckpt.load_model(tmp_path / "full")
    _, params_split, state_split = ckpt.load_model(tmp_path / "split", step=6)
    leaves_full, leaves_split = (__import__("jax").tree.leaves(t) for t in ((params_full, state_full),
                                                                          (params_split, state_split)))
    assert len(leaves_full) == len(leaves_split) > 10
    assert np.abs(np.asarray(state_full["router_common"])).min() > 0  # every router's mean moved
    for a, b in zip(leaves_full, leaves_split, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cadences_and_a_stop_signal_of_a_resumed_run(tmp_path, trained, monkeypatch):
    """The 40-step run resumed to step 47 with other cadences: records, evaluations and checkpoints at their
    multiples and at the last step. SIGTERM, then SIGINT while stopping, during step 45 (evaluated, not
    checkpointed) stop it there with a checkpoint of 45 and SIGTERM's status; the same signals during the last
    step stop nothing, the run has ended."""
    config, run_dir, _ = trained
    shutil.copytree(run_dir, tmp_path / "run")
    write = MetricsWriter.write

    def write_then_signal(self, record):
        write(self, record)
        if "eval_loss" in record and record["step"] in (45, 47):
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(MetricsWriter, "write", write_then_signal)
    resumed = config.replace(**{"train.steps": 47, "train.log_every": 2, "train.eval_every": 3,
                                "train.checkpoint_every": 4, "train.keep_checkpoints": 10, "train.plot": False})
    stopped = train(resumed, tmp_path / "run", resume=True, progress=False, log=lambda s: None)
    assert (stopped.first_step, stopped.last_step, stopped.stopped_by, stopped.exit_status) == (40, 45, "SIGTERM", 143)
    assert ckpt.latest_step(tmp_path / "run") == 45
    lines = []
    finished = train(resumed, tmp_path / "run", resume=True, progress=False, log=lines.append)
    assert (finished.first_step, finished.last_step, finished.stopped_by, finished.exit_status) == (45, 47, None, 0)
    assert "dropless: resuming from checkpoint 45, to step 47" in lines, lines
    records = [r for r in read_metrics(tmp_path / "run") if r["step"] > 40]
    assert [r["step"] for r in records if "loss" in r] == [42, 44, 46, 47]
    assert [r["step"] for r in records if "eval_loss" in r] == [42, 45, 47]
    assert [step for step, _ in finished.eval_losses] == [0, 40, 42, 45, 47]
    with ckpt.manager(tmp_path / "run", read_only=True) as mngr:
        assert sorted(mngr.all_steps()) == [40, 44, 45, 47]


def test_every_step_is_held_to_the_dropless_invariant_logged_or_not(corpus):
    """The loop reads the steps' drop counts where the host waits anyway (a logged, evaluated or saved step) and
    checks each step since the last read: a drop at an unlogged step is named with its own step."""
    counter = _DropCounter(small_config(corpus))
    for count in (0, 0, 0):
        counter.add(jnp.asarray(count, jnp.int32))
    counter.check(3)
    for count in (0, 2, 0):
        counter.add(jnp.asarray(count, jnp.int32))
    with pytest.raises(RuntimeError, match="internal error: 2 tokens dropped at step 5 on a dropless path"):
        counter.check(6)
    capacity = _DropCounter(small_config(corpus, **{"moe.gmm_backend": "capacity"}))
    for count in (1, 2, 4):
        capacity.add(jnp.asarray(count, jnp.int32))
    capacity.check(3)
    assert capacity.total == 7 and not capacity.pending


def test_the_summary_counts_every_token_the_capacity_baseline_drops(tmp_path, corpus, monkeypatch):
    """Every step's drops, whether or not its metrics are logged (the two runs are the same bits); likewise the
    tokens a logged record's tokens_per_s (and tflops_per_device, mfu) divides by the seconds since the last one."""
    config = small_config(corpus, **{"train.steps": 3, "train.eval_every": 100, "train.checkpoint_every": 100,
                                     "train.plot": False, "moe.gmm_backend": "capacity", "moe.capacity_factor": 0.5})
    tokens, throughput = [], metrics_lib.throughput
    monkeypatch.setattr(metrics_lib, "throughput",
                        lambda count, *args: tokens.append(count) or throughput(count, *args))
    summary = train(config, tmp_path / "run", progress=False, log=lambda s: None)
    dropped = [r["tokens_dropped"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(dropped) == 3 and min(dropped) > 0
    assert summary.tokens_dropped == sum(dropped)
    lines = []
    sparse = train(config.replace(**{"train.log_every": 2}), tmp_path / "sparse", progress=False, log=lines.append)
    assert [r["step"] for r in read_metrics(tmp_path / "sparse") if "loss" in r] == [2, 3]
    assert sparse.tokens_dropped == sum(dropped)
    # Without the progress bar each logged step's figures are a line of their own, through `log`.
    steps = [line.split()[2] for line in lines if line.startswith("dropless: step ") and " loss=" in line]
    assert steps == ["2", "3"], lines
    step_tokens = config.train.batch_size * config.train.seq_len
    assert tokens == [step_tokens] * 3 + [2 * step_tokens, step_tokens]


def test_resuming_a_finished_run_trains_nothing_and_says_so(tmp_path, trained):
    config, run_dir, _ = trained
    shutil.copytree(run_dir, tmp_path / "run")
    lines = []
    summary = train(config, tmp_path / "run", resume=True, progress=False, log=lines.append)
    assert (summary.first_step, summary.last_step, summary.stopped_by, summary.exit_status) == (40, 40, None, 0)
    assert "dropless: the run is already at step 40 of 40; raise --steps to train further." in lines
    assert [step for step, _ in summary.eval_losses] == [0, 40] and ckpt.latest_step(tmp_path / "run") == 40


def test_metrics_keep_each_step_once_and_tolerate_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(6)) + '{"step": 6, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(6))
    assert [r["step"] for r in keep_records_through(tmp_path, 3)] == [0, 1, 2, 3]
    assert path.read_text().endswith("\n") and [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    path.write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(MetricsError, match="line 2"):
        read_metrics(tmp_path)


def test_run_dir_with_other_config_is_refused(tmp_path, trained):
    config, run_dir, _ = trained
    shutil.copytree(run_dir, tmp_path / "run")  # a run with a checkpoint, of its own
    other = config.replace(**{"moe.num_experts_per_tok": 1})
    with pytest.raises(config_lib.ConfigError, match=r"different config \(moe.num_experts_per_tok: 2 saved, 1 "
                       r"given\); --resume continues it only without that override"):
        train(other, tmp_path / "run", progress=False, log=lambda s: None)
    with pytest.raises(config_lib.ConfigError, match=r"\(train.steps: 40 saved, 41 given\); pass --resume to "
                       "continue it with the given settings"):
        train(config.replace(**{"train.steps": 41}), tmp_path / "run", progress=False, log=lambda s: None)
    with pytest.raises(config_lib.ConfigError, match="moe.num_experts_per_tok differs"):
        train(other, tmp_path / "run", resume=True, progress=False, log=lambda s: None)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["moe"]["num_experts_per_tok"] == 2  # a refused run leaves what was saved untouched


def test_eval_scores_every_sequence_of_the_held_out_split_with_the_latest_checkpoint(trained, tmp_path, capsys):
    """`dropless eval --run-dir` reads the run's own tokenizer and data, cuts the held-out split as training did,
    and scores every sequence of it: the float64 cross-entropy of their exact float32 logits."""
    from dropless import cli
    from dropless.data import TextTokenizer, load_token_dataset
    from tests.test_cli_errors import assert_one_line, run_main
    from tests.test_train_evaluate import reference_loss

    config, run_dir, summary = trained
    out = tmp_path / "eval.json"
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    with pytest.MonkeyPatch.context() as patch:  # the run's token cache holds its data: nothing is tokenized
        patch.setattr(TextTokenizer, "encode_batch", lambda *args: pytest.fail("eval tokenized the run's data"))
        assert cli.main(["eval", "--run-dir", str(run_dir), "--json", str(out)]) == 0
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")} == before  # and nothing is written
    record = json.loads(out.read_text())
    _, params, state = ckpt.load_model(run_dir)
    data = config.replace(**{"data.tokenizer": str(run_dir / "tokenizer.json")}).data
    dataset, _ = load_token_dataset(data, config.model.vocab_size, config.train.seq_len)
    held_out, count = dataset.eval_stream, dataset.num_eval_sequences
    tokens = held_out.windows(np.zeros(1, np.int64), len(held_out))[0]
    assert (record["sequences"], record["tokens"], record["tokens_dropped"], record["step"]) == (count, count * 32, 0, 40)
    assert record["loss"] == pytest.approx(reference_loss(config, params, state, tokens, 32, count), rel=2e-6)
    assert record["data"].startswith("the held-out split of ") and "held-out split" in capsys.readouterr().out
    # The run's last evaluation scored train.eval_batches x batch_size of these sequences, spread over them.
    assert record["loss"] == pytest.approx(summary.eval_losses[-1][1], rel=0.1)
    assert cli.main(["eval", "--run-dir", str(run_dir), "--step", "40", "--max-sequences", "2"]) == 0
    assert "over 64 tokens (2 sequences of 32)" in capsys.readouterr().out
    for command in (["eval"], ["generate", "--prompt", "def"]):
        assert_one_line(*run_main(capsys, *command, "--run-dir", str(run_dir), "--step", "7"),
                        "has no checkpoint for step 7; the saved steps are [40].")
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "tokenizer.json").unlink()
    assert_one_line(*run_main(capsys, "eval", "--run-dir", str(copy)), "copy/tokenizer.json is missing, and the "
                    "run's weights were trained with it; put it back (from a copy of the run) or give it with "
                    "--tokenizer.")
