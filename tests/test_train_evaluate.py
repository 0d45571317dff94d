"""dropless.train.evaluate and `dropless eval`: every token of the data scored once, on every mesh, equal to a
float64 cross-entropy of the exact float32 logits (`dropless.convert.compute_logits`)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dropless import cli
from dropless.convert import compute_logits, load_hf
from dropless.core import config as config_lib
from dropless.data import DataError, TokenStream
from dropless.models import transformer
from dropless.train import checkpoint as ckpt
from dropless.train.evaluate import Evaluation, evaluate
from tests.test_cli_errors import assert_one_line, run_main
from tests.test_train import SMALL

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


def reference_loss(config, params, state, tokens: np.ndarray, seq_len: int, count: int) -> float:
    """The mean float64 cross-entropy of the first `count` sequences stream[i*S : i*S + S + 1]."""
    windows = np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)])
    logits = compute_logits(config, params, state, windows[:, :-1]).astype(np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return float(-np.take_along_axis(log_probs, windows[:, 1:, None], -1).mean())


@pytest.mark.parametrize("overrides", [{}, {"parallel.fsdp": 2, "parallel.expert": 4, "train.grad_accum_steps": 2,
                                            "train.batch_size": 16}])
def test_every_token_is_scored_once_on_every_mesh(overrides):
    """1.25 batches of sequences: the second batch is filled with copies weighted 0, so the loss is the mean over
    exactly the sequences' targets, as the float64 reference computes it; the trailing partial sequence is left
    out, and so is a sequence past --max-sequences."""
    config = config_lib.load_preset("tiny").replace(**{**SMALL, "train.seq_len": 16, **overrides})
    params = transformer.init_params(jax.random.key(0), config)
    state = transformer.init_state(config)
    count = config.train.batch_size * 5 // 4
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, count * 16 + 9).astype(np.int32)
    result = evaluate(config, params, state, TokenStream([tokens[:50], tokens[50:]]))
    assert (result.sequences, result.tokens, result.seq_len, result.tokens_dropped) == (count, count * 16, 16, 0)
    want = reference_loss(config, params, state, tokens, 16, count)
    assert result.loss == pytest.approx(want, rel=2e-6)
    assert result.perplexity == pytest.approx(np.exp(want), rel=1e-5)
    first = evaluate(config, params, state, TokenStream([tokens]), max_sequences=3)
    if not overrides:  # the capacity baseline's drops depend on the batch: scored on whole batches only
        capacity = config.replace(**{"moe.gmm_backend": "capacity"})
        with pytest.raises(DataError, match=r"capacity drops tokens by batch, so a partial last batch \(2 of 8 "):
            evaluate(capacity, params, state, TokenStream([tokens]))
        assert evaluate(capacity, params, state, TokenStream([tokens]), max_sequences=8).sequences == 8
    assert first.tokens == 48 and first.loss == pytest.approx(reference_loss(config, params, state, tokens, 16, 3),
                                                              rel=2e-6)


def test_eval_of_a_hugging_face_checkpoint_on_a_token_file(tmp_path, capsys):
    """`dropless eval --hf-dir --data tokens.npy` scores the whole file with the checkpoint's model; the figures
    go to stdout and, with --json, to a file."""
    tokens = np.random.default_rng(1).integers(0, 128, 5 * 24 + 1).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    out = tmp_path / "figures" / "eval.json"  # its folder made before the scoring
    assert cli.main(["eval", "--hf-dir", str(FIXTURES / "mixtral"), "--data", str(tmp_path / "tokens.npy"),
                     "--json", str(out), "train.batch_size=8", "train.seq_len=24", "train.dtype=float32"]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    config, params, state = load_hf(FIXTURES / "mixtral")
    want = reference_loss(config, params, state, tokens, 24, 5)
    assert record["loss"] == pytest.approx(want, rel=2e-6)
    assert (record["tokens"], record["sequences"], record["tokens_dropped"]) == (120, 5, 0)
    assert f"loss {want:.4f}, perplexity {np.exp(want):.2f}, over 120 tokens (5 sequences of 24)" in printed


def test_eval_refuses_what_it_cannot_score(tmp_path, capsys):
    hf = str(FIXTURES / "mixtral")
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", hf), "holds a Hugging Face model, which has no data of its "
                    "own to score; give the text or tokens to score with --data PATH.")
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", hf, "--data", "x.npy", "model.hidden_size=64"),
                    "eval scores the model as it was saved, and model.hidden_size is part of the model; set only")
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", hf, "--data", "x.npy", "trian.batch_size=8"),
                    "Unknown config key 'trian.batch_size'", "train.batch_size")
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", hf, "--data", "x.npy", "--max-sequences", "0"),
                    "--max-sequences must be at least 1; got 0.")
    for command in (["eval", "--data", "x.npy"], ["generate", "--prompt", "x"], ["logits", "--tokens", "t.npy",
                                                                                 "--out", "o.npy"]):
        assert_one_line(*run_main(capsys, *command, "--hf-dir", hf, "--step", "3"),
                        "--step picks a checkpoint of a --run-dir; a Hugging Face directory holds one set of weights")
        assert_one_line(*run_main(capsys, *command, "--run-dir", str(tmp_path), "--step", "-1"),
                        "--step must be a checkpoint's step (>= 0); got -1.")
    np.save(tmp_path / "short.npy", np.arange(20, dtype=np.int32))
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", hf, "--data", str(tmp_path / "short.npy"),
                              "train.seq_len=24", "train.batch_size=8"),
                    "the data holds 20 tokens, fewer than one sequence of train.seq_len+1=25")
    # The model's vocabulary is fixed: the advice is the model's tokenizer before a larger vocabulary.
    np.save(tmp_path / "wide.npy", np.arange(200, dtype=np.int32))
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", hf, "--data", str(tmp_path / "wide.npy")),
                    "holds token id 199, beyond the vocabulary of model.vocab_size=128; re-tokenize it with the "
                    "model's tokenizer, or for a new model set model.vocab_size=200 or more.")
    (tmp_path / "doc.txt").write_text("some text")
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", hf, "--data", str(tmp_path / "doc.txt")),
                    "is text and no tokenizer is given; give the model's tokenizer.json (--tokenizer")
    # The mesh is checked before the data is read (a missing file here): tokenizing a corpus can take minutes.
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", hf, "--data", str(tmp_path / "missing.npy"),
                              "train.batch_size=12"), "train.batch_size=12 is not divisible by the 8 devices")


def test_a_diverged_model_s_figures_are_written_as_null(tmp_path, monkeypatch, capsys):
    """JSON has no NaN or infinity: a loss that is not finite, and its perplexity, are written as null."""
    np.save(tmp_path / "tokens.npy", np.zeros(100, np.int32))
    monkeypatch.setattr(cli, "evaluate", lambda *args, **kwargs: Evaluation(float("nan"), 48, 2, 24, 0))
    assert cli.main(["eval", "--hf-dir", str(FIXTURES / "mixtral"), "--data", str(tmp_path / "tokens.npy"),
                     "--json", str(tmp_path / "eval.json"), "train.seq_len=24", "train.batch_size=8"]) == 0
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["loss"] is None and record["perplexity"] is None and record["tokens"] == 48
    assert "loss nan, perplexity nan" in capsys.readouterr().out


def test_eval_of_a_run_with_a_validation_corpus_scores_that_corpus(tmp_path, capsys):
    """A run trained with data.eval_source holds out that corpus: `dropless eval --run-dir` scores all of it."""
    np.save(tmp_path / "train.npy", np.arange(2000, dtype=np.int32) % 320)
    valid = np.random.default_rng(2).integers(0, 320, 3 * 16 + 1).astype(np.int32)
    np.save(tmp_path / "valid.npy", valid)
    config = config_lib.load_preset("tiny").replace(**{**SMALL, "train.seq_len": 16, "data.source": str(
        tmp_path / "train.npy"), "data.eval_source": str(tmp_path / "valid.npy")})
    params, state = transformer.init_params(jax.random.key(0), config), transformer.init_state(config)
    ckpt.save_model(tmp_path / "run", config, params, state, step=5)
    (tmp_path / "train.npy").unlink()  # scoring the validation corpus reads nothing of the training data
    assert cli.main(["eval", "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "eval.json")]) == 0
    record = json.loads((tmp_path / "eval.json").read_text())
    assert record["data"] == f"the run's validation corpus, data.eval_source '{tmp_path / 'valid.npy'}'"
    assert (record["sequences"], record["step"]) == (3, 5)
    assert record["loss"] == pytest.approx(reference_loss(config, params, state, valid, 16, 3), rel=2e-6)
    assert "validation corpus" in capsys.readouterr().out
