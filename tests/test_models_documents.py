"""data.document_mask: attention within each document of a packed sequence. Each document's logits and gradients
are those of the document run alone, for MLA and GQA, the MTP module's too; the flash-attention backend's mask
equals the reference's; a run on text records its tokenizer's end-of-document id and resumes with it. Under
expert parallelism: `test_train_parallel.test_routers_common_direction_and_attention_within_documents_with_expert_parallelism_match_one_device`."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.bench import harness
from dropless.core.config import ConfigError
from dropless.data import DataError, TextTokenizer, loader, train_bpe
from dropless.models import attention, transformer
from dropless.train import checkpoint as ckpt
from dropless.train.loop import train
from dropless.train.step import loss_fn
from tests.test_cli_errors import assert_one_line, run_main
from tests.test_models_transformer import FAMILIES, FORWARD, _setup
from tests.test_train import CORPUS, corpus, small_config  # noqa: F401 (corpus: the module's corpus fixture)
from tests.test_train_evaluate import FIXTURES

EOS = 3
# Two rows of 24 positions: three documents, the last cut off by the row's end; two, the second ending at it.
LENGTHS = ([7, 10, 7], [12, 12])


def _packed(vocab: int) -> tuple[np.ndarray, list[list[tuple[int, int]]]]:
    """(tokens [2, 24] with EOS ending each document but the first row's last, each row's (start, stop) spans)."""
    rng = np.random.default_rng(0)
    rows, spans = [], []
    for r, lengths in enumerate(LENGTHS):
        row, row_spans = [], []
        for d, length in enumerate(lengths):
            document = rng.integers(EOS + 1, vocab, length)
            if not (r == 0 and d == len(lengths) - 1):
                document[-1] = EOS
            row_spans.append((len(row), len(row) + length))
            row.extend(document)
        rows.append(row)
        spans.append(row_spans)
    return np.asarray(rows, np.int32), spans


def _masked(name: str, **overrides):
    return FAMILIES[name].replace(**{"train.seq_len": 24, "data.document_mask": True, "data.eos_id": EOS,
                                     **overrides})


def _alone(tokens: np.ndarray, spans) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Each document alone, one per row, padded at its end to the longest (a causal model's positions do not see
    what follows them): ([documents, 12] tokens, (row, start, stop) of each)."""
    where = [(r, a, b) for r, row in enumerate(spans) for a, b in row]
    alone = np.full((len(where), max(b - a for _, a, b in where)), EOS + 1, np.int32)
    for i, (r, a, b) in enumerate(where):
        alone[i, :b - a] = tokens[r, a:b]
    return alone, where


@functools.partial(jax.jit, static_argnums=4)
def _jitted_logits_and_grads(params, state, tokens_BS, weights_BSV, config):
    def objective(p):
        logits_BSV = transformer.forward(p, state, tokens_BS, config)[0]
        return jnp.sum(logits_BSV * weights_BSV), logits_BSV

    (_, logits_BSV), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return logits_BSV, grads


def _logits_and_grads(params, state, tokens_BS, weights_BSV, config):
    """(logits, the gradient of their sum weighted by `weights_BSV`), from one program, as numpy arrays: each slice
    or reduction of a JAX array would compile a program of its own."""
    return jax.device_get(_jitted_logits_and_grads(params, state, tokens_BS, weights_BSV, config))


@pytest.mark.parametrize("name", ["deepseek_v3", "mixtral"])
def test_each_document_of_a_packed_sequence_is_computed_as_if_alone(name):
    """Logits, and the gradient of a weighted sum of them, against each document run alone (RoPE's relative
    positions make its offset in the row irrelevant, up to rounding); without the mask the later documents
    differ."""
    config = _masked(name)
    unmasked_config = config.replace(**{"data.document_mask": False})
    params, state, _ = _setup(config)
    tokens, spans = _packed(config.model.vocab_size)
    alone, where = _alone(tokens, spans)
    weights = np.asarray(jax.random.normal(jax.random.key(3), (*tokens.shape, config.model.vocab_size)))
    # One unmasked pass: the documents alone (padded at their end to the rows' width), then the packed rows
    # unmasked with zero weights (their logits only; each token's logits and routing are its own, so they add
    # nothing to the documents' gradient).
    unmasked_tokens = np.concatenate([np.pad(alone, ((0, 0), (0, tokens.shape[1] - alone.shape[1])),
                                             constant_values=EOS + 1), tokens])
    unmasked_weights = np.zeros((*unmasked_tokens.shape, config.model.vocab_size), np.float32)
    for i, (r, a, b) in enumerate(where):
        unmasked_weights[i, :b - a] = weights[r, a:b]

    (packed, got), (unmasked_logits, want) = (_logits_and_grads(params, state, t, w, c) for t, w, c in (
        (tokens, weights, config), (unmasked_tokens, unmasked_weights, unmasked_config)))
    by_itself, unmasked = unmasked_logits[:len(where)], unmasked_logits[len(where):]
    scale = float(np.abs(packed).max())
    for i, (r, a, b) in enumerate(where):
        np.testing.assert_allclose(packed[r, a:b], by_itself[i, :b - a], rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=f"row {r} document [{a}, {b})")
    assert float(np.abs(unmasked[0, 7:] - packed[0, 7:]).max()) > 1e-3 * scale  # the mask is what separates them
    np.testing.assert_allclose(unmasked[:, :7], packed[:, :7], rtol=1e-5, atol=1e-6 * scale)  # first documents
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max()) + 1e-12,
                                   err_msg=jax.tree_util.keystr(path))


def test_the_mtp_module_attends_within_documents_too():
    """Depth 1 at position i reads token i + 1: inside a document (i + 1 before its end) its logits are the
    document's own."""
    config = _masked("deepseek_v3", **{"model.mtp_layers": 1})
    params, state, _ = _setup(config)
    tokens, spans = _packed(config.model.vocab_size)
    alone, where = _alone(tokens, spans)

    def mtp(tokens_BS, c):  # FORWARD's programs: the next test's pass on the documents alone is this one's
        return FORWARD(params, state, tokens_BS, c, mtp=True)[1]["mtp_logits"][0]

    packed = mtp(tokens, config)
    by_itself = mtp(alone, config.replace(**{"data.document_mask": False}))
    scale = float(jnp.abs(packed).max())
    for i, (r, a, b) in enumerate(where):
        np.testing.assert_allclose(packed[r, a:b - 1], by_itself[i, :b - a - 1], rtol=1e-4, atol=1e-5 * scale)


def test_the_mtp_loss_scores_the_positions_each_document_has_alone():
    """Depth 1 scores position i on token i + 2 only where token i + 1, its input, lies in i's document: the
    float64 cross-entropy of each document's own MTP logits (run alone) over those positions, divided by every
    position of the batch that has a target (the denominator training uses without the mask)."""
    config = _masked("deepseek_v3", **{"model.mtp_layers": 1})
    params, state, _ = _setup(config)
    tokens, spans = _packed(config.model.vocab_size)
    batch = np.concatenate([tokens, np.full((2, 1), EOS + 1, np.int32)], axis=1)  # [2, 25]: a target for each
    alone, where = _alone(tokens, spans)
    _, aux = FORWARD(params, state, alone, config.replace(**{"data.document_mask": False}), mtp=True)
    logits = np.asarray(aux["mtp_logits"][0], np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    total = sum(-log_probs[d, i - a, batch[r, i + 2]] for d, (r, a, b) in enumerate(where) for i in range(a, b - 1))
    _, (_, got) = jax.jit(loss_fn, static_argnums=3)(params, state, batch, config)
    assert float(got["mtp_loss"]) == pytest.approx(total / (2 * 23), rel=1e-5)
    _, (_, unmasked) = jax.jit(loss_fn, static_argnums=3)(params, state, batch, config.replace(
        **{"data.document_mask": False}))
    assert abs(float(unmasked["mtp_loss"]) - float(got["mtp_loss"])) > 1e-3


def test_flash_attention_takes_the_documents_as_key_starts_and_gives_the_reference(monkeypatch):
    """model.attention_backend=tokamax (its XLA implementation on a CPU) gives the einsum reference's logits and
    gradients (of a weighted logit sum, every parameter), with the documents given to it as each query's first key
    (its mask's `k_start`), never as an [S, S] boolean mask."""
    from tokamax._src.ops.attention import api
    masks = []
    xla = api.IMPLEMENTATIONS["xla"]

    def spy(*args, mask, **kwargs):
        masks.append(mask)
        return xla(*args, mask=mask, **kwargs)

    monkeypatch.setattr(api, "IMPLEMENTATIONS", {**api.IMPLEMENTATIONS, "xla": spy})
    config = _masked("mixtral")
    params, state, _ = _setup(config)
    tokens, _ = _packed(config.model.vocab_size)
    weights = np.asarray(jax.random.normal(jax.random.key(3), (*tokens.shape, config.model.vocab_size)))
    want, want_grads = _logits_and_grads(params, state, tokens, weights, config)
    got, got_grads = _logits_and_grads(params, state, tokens, weights,
                                       config.replace(**{"model.attention_backend": "tokamax"}))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max()),
                                   err_msg=jax.tree_util.keystr(path))
    assert masks and all(m.bool_mask is None and m.is_causal and m.k_start.shape == (2, 1, 24) for m in masks)


def test_document_starts_are_each_positions_first_position_of_its_document():
    tokens = jnp.asarray([[5, EOS, 6, 7, EOS, EOS, 8], [EOS, 5, 6, 7, 8, 9, EOS]])
    documents = transformer.document_ids(tokens, _masked("mixtral"))
    np.testing.assert_array_equal(attention.document_starts(documents), [[0, 0, 2, 2, 2, 5, 6], [0, 1, 1, 1, 1, 1, 1]])


def test_document_ids_and_settings_that_cannot_be_kept_are_refused():
    tokens = jnp.asarray([[5, EOS, 6, 7, EOS, EOS, 8]])
    np.testing.assert_array_equal(transformer.document_ids(tokens, _masked("mixtral")), [[0, 0, 1, 1, 1, 2, 3]])
    assert transformer.document_ids(tokens, FAMILIES["mixtral"]) is None
    with pytest.raises(ConfigError, match="data.document_mask needs the end-of-document id .* set data.eos_id"):
        transformer.document_ids(tokens, _masked("mixtral", **{"data.eos_id": -1}))
    with pytest.raises(ConfigError, match=r"data.eos_id=-2 must be a token id \(>= 0\), or -1"):
        _masked("mixtral", **{"data.eos_id": -2})
    with pytest.raises(ConfigError, match="data.eos_id=64 is not an id of the model's vocabulary"):
        _masked("mixtral", **{"data.eos_id": 64})
    with pytest.raises(ConfigError, match="model.attention_backend=cudnn runs cuDNN's causal mask only"):
        _masked("mixtral", **{"model.attention_backend": "cudnn"})


def test_a_run_on_text_records_its_tokenizer_s_end_of_document_id(tmp_path, corpus, capsys):
    """The id is resolved before the data is read (the trained tokenizer's <|endoftext|>, 0), saved, trained with
    and kept on resume, and `dropless eval` scores with it; the benchmarks' step resolves it as a run does."""
    config = small_config(corpus, **{"data.document_mask": True, "train.steps": 2, "train.eval_every": 2,
                                     "train.checkpoint_every": 2, "train.plot": False,
                                     "model.num_layers": 1})  # the id's bookkeeping: one (dense) layer will do
    quiet = {"progress": False, "log": lambda s: None}
    summary = train(config, tmp_path / "run", **quiet)
    assert np.isfinite(summary.eval_losses[-1][1])
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data"]["eos_id"] == 0
    train(config.replace(**{"train.steps": 3}), tmp_path / "run", resume=True, **quiet)  # -1 given: the saved 0
    assert ckpt.load_run_config(tmp_path / "run").data.eos_id == 0
    assert harness.build(config, jax.devices()[:1]).config.data.eos_id == 0
    assert_one_line(*run_main(capsys, "eval", "--run-dir", str(tmp_path / "run"), "data.eos_id=5"),
                    "data.eos_id=5, but the documents of data.source", "end in the tokenizer's end-of-document id 0; "
                    "data.document_mask reads one id for all the data, so leave data.eos_id unset (-1) where the "
                    "data is text.")


def test_an_end_of_document_id_the_data_does_not_use_is_refused_before_the_data_is_read(tmp_path, corpus,
                                                                                          monkeypatch):
    """Text data may not name another id than its tokenizer's; token data must name its own, and a text validation
    corpus beside it ends in the tokenizer's. Each refusal comes before tokenizing and leaves nothing behind."""
    monkeypatch.setattr(TextTokenizer, "encode_batch", lambda *args: pytest.fail("tokenized before the refusal"))
    monkeypatch.setattr(loader, "train_bpe", lambda *args: pytest.fail("trained a tokenizer before the refusal"))
    config = small_config(corpus, **{"data.document_mask": True})
    np.save(tmp_path / "tokens.npy", np.arange(2000) % 300)
    tokens = config.replace(**{"data.source": str(tmp_path / "tokens.npy")})
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(["def f(x):\n    return x\n"] * 20, 300).save(tokenizer)
    for refused, fragment in (
            (config.replace(**{"data.eos_id": 5}), "data.eos_id=5, but the documents of data.source"),
            (tokens, "holds token ids with its own separators; name the id that ends each document with data.eos_id"),
            (tokens.replace(**{"data.eos_id": 299, "data.eval_source": str(corpus), "data.tokenizer": str(tokenizer)}),
             "data.eos_id=299, but the documents of data.eval_source")):
        with pytest.raises(DataError, match=re.escape(fragment)):
            train(refused, tmp_path / "refused", progress=False, log=lambda s: None)
        assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())
    # A tokenizer too large for the model is named as such, not its end-of-document id as outside the vocabulary.
    train_bpe([CORPUS], 2048).save(tokenizer)
    with pytest.raises(DataError, match="tokens but model.vocab_size=320; use the model's own tokenizer"):
        train(config.replace(**{"data.tokenizer": str(tokenizer)}), tmp_path / "refused", progress=False,
              log=lambda s: None)


def test_eval_of_token_data_with_the_document_mask_needs_its_separator(tmp_path, capsys):
    np.save(tmp_path / "tokens.npy", np.arange(200, dtype=np.int32) % 100)
    assert_one_line(*run_main(capsys, "eval", "--hf-dir", str(FIXTURES / "mixtral"), "--data",
                              str(tmp_path / "tokens.npy"), "data.document_mask=true"),
                    "data.document_mask splits sequences at end-of-document ids, and data.source", "tokens.npy' holds "
                    "token ids with its own separators; name the id that ends each document with data.eos_id=N.")
