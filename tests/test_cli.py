"""The CLI: user mistakes give one line on stderr, exit status 2, no traceback (in this process, and once through the
real command); train and fine-tune through the real command, in subprocesses; resume and generate after it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dropless import cli
from tests.test_cli_errors import assert_one_line, run_main
from tests.test_train import SMALL, TRAINED_SCHEDULE, write_corpus


def run_cli(*args: str, cwd=None, one_device: bool = False) -> subprocess.CompletedProcess:
    """`python -m dropless.cli *args` on the suite's CPU devices, or with `one_device` on one (where what is tested
    is the command, not the mesh: a step on 8 virtual devices compiles and saves its first checkpoint slower)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if one_device:
        xla_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count=1".strip()
    return subprocess.run([sys.executable, "-m", "dropless.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("dropless: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("args, fragments", [
    (["train", "moe.gmm_backnd=xla"], ["Unknown config key 'moe.gmm_backnd'", "moe.gmm_backend"]),
    (["train", "moe.num_experts_per_tok=99"], ["moe.num_experts_per_tok=99", "between 1 and"]),
    (["train", "moe.n_group=3"], ["moe.n_group=3 must divide"]),
    (["train", "train.dtype=float16"], ["train.dtype", "bfloat16, float32"]),
    (["train", "train.steps=many"], ["train.steps", "integer"]),
    (["train", "oops"], ["key=value"]),
    (["train", "--preset", "tinny"], ["Unknown preset 'tinny'", "tiny"]),
    (["train", "--steps"], ["expected one argument"]),
    (["train", "--bogus-flag"], ["unrecognized arguments"]),
    (["train", "--data", "/no/such/corpus.txt", "--steps", "1"], ["/no/such/corpus.txt"]),
    (["generate", "--run-dir", "/no/such/run", "--prompt", "x"], ["/no/such/run"]),
    (["logits", "--run-dir", "/no/such/run", "--tokens", "/no/t.npy", "--out", "/tmp/o.npy"], ["/no/t.npy"]),
])
def test_user_mistakes_get_one_clear_line(tmp_path, monkeypatch, capsys, args, fragments):
    monkeypatch.chdir(tmp_path)  # where a default run directory would go
    assert_one_line(*run_main(capsys, *args), *fragments)


def test_a_user_mistake_is_one_line_from_the_real_command(tmp_path):
    """As above, through `python -m dropless.cli` in a fresh process: nothing printed while the libraries load (a
    warning, a log line) joins the one line on stderr, and the status is the process's."""
    assert_user_error(run_cli("train", "--data", "/no/such/corpus.txt", "--steps", "1", cwd=tmp_path),
                      "/no/such/corpus.txt")
    assert_user_error(run_cli("train", "moe.gmm_backnd=xla", cwd=tmp_path), "Unknown config key 'moe.gmm_backnd'")


def test_presets_lists_every_preset(capsys):
    """The listing, read in this process (test_a_user_mistake_is_one_line_from_the_real_command starts the real
    command)."""
    assert cli.main(["presets"]) == 0
    printed = capsys.readouterr().out
    for name in ("tiny", "deepseek-v3-671b", "deepseek-v3-proxy", "mixtral-8x7b", "qwen3-30b-a3b"):
        assert name in printed


def test_train_then_generate_and_resume_through_the_cli(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus")
    overrides = [f"{k}={v}" for k, v in {**SMALL, **TRAINED_SCHEDULE}.items()] + [
        "train.eval_every=4", "train.checkpoint_every=2", "train.plot=false"]  # test_train reads training.png
    run_dir = tmp_path / "run"
    first = run_cli("train", "--data", str(corpus), "--steps", "2", "--run-dir", str(run_dir), "--no-progress",
                    *overrides)
    assert first.returncode == 0, first.stderr
    assert str(run_dir.resolve()) in first.stdout  # the run directory is printed at start
    again = run_main(capsys, "train", "--data", str(corpus), "--steps", "2", "--run-dir", str(run_dir), *overrides)
    assert_one_line(*again, "already holds", "--resume")
    # The resume and the sample run in this process (the command's code path, without a second interpreter's
    # start-up): the first run above is the real command.
    assert cli.main(["train", "--data", str(corpus), "--steps", "4", "--run-dir", str(run_dir), "--resume",
                     "--no-progress", *overrides]) == 0
    capsys.readouterr()
    assert cli.main(["generate", "--run-dir", str(run_dir), "--prompt", "def ", "--max-new-tokens", "5",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.parametrize("eos", ["<|endoftext|>", "</s>", "<|im_end|>"])
def test_generate_stops_at_the_end_of_document_token_training_used(tmp_path, monkeypatch, capsys, eos):
    """A run trained with a given tokenizer separates its documents with that tokenizer's end-of-document token
    (`TextTokenizer.eos_id`), which need not be <|endoftext|>: generation stops at the same one."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from dropless.core import config as config_lib
    from dropless.data import TextTokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["def f(x):\n    return x\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = config_lib.load_preset("tiny").replace(**SMALL)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    tokenizer.save(str(run_dir / "tokenizer.json"))
    seen = {}
    monkeypatch.setattr(cli, "_load_for_inference", lambda args, **kwargs: (config, None, None))
    monkeypatch.setattr(cli, "generate", lambda *args, **kwargs: seen.update(kwargs) or [])
    assert cli.main(["generate", "--run-dir", str(run_dir), "--prompt", "def "]) == 0
    assert seen["stop_id"] == TextTokenizer(tokenizer).eos_id == tokenizer.token_to_id(eos) == 1


@pytest.mark.parametrize("imported", [False, True])
def test_generate_encodes_the_prompt_as_the_model_saw_text(tmp_path, monkeypatch, imported):
    """A run dropless trained saw documents encoded by `TextTokenizer` (no BOS, "<|endoftext|>" in the text as
    text): the prompt is encoded the same way. A run imported from Hugging Face keeps the tokenizer's own rules,
    its BOS included, as transformers encodes."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    from dropless.core import config as config_lib
    from dropless.data import TextTokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["def f(x):\n    return x\n"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = config_lib.load_preset("tiny").replace(**SMALL)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    tokenizer.save(str(run_dir / "tokenizer.json"))
    if imported:
        (run_dir / "hf_source.json").write_text("{}")
    seen = []
    monkeypatch.setattr(cli, "_load_for_inference", lambda args, **kwargs: (config, None, None))
    monkeypatch.setattr(cli, "generate", lambda config, params, state, ids, **kwargs: seen.append(list(ids)) or [])
    prompt = "def f<|endoftext|>"
    assert cli.main(["generate", "--run-dir", str(run_dir), "--prompt", prompt]) == 0
    as_trained = TextTokenizer(Tokenizer.from_str(tokenizer.to_str())).encode(prompt).tolist()
    assert 0 not in as_trained and 1 not in as_trained  # text, not the special tokens
    assert seen == [tokenizer.encode(prompt).ids if imported else as_trained]
    assert (seen[0][0] == 1) == imported  # the BOS


def test_generate_prints_the_space_a_sentencepiece_tokenizer_opens_the_continuation_with(tmp_path, monkeypatch,
                                                                                          capsys):
    """Mixtral's and Llama's tokenizer.json strip the space of the first token they decode: "▁world" decoded alone
    is "world", so the continuation is decoded after the prompt, as "Hello world"."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from dropless.core import config as config_lib

    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.train_from_iterator(["Hello world and more world"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = config_lib.load_preset("tiny").replace(**SMALL)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict()))
    tokenizer.save(str(run_dir / "tokenizer.json"))
    world = tokenizer.token_to_id("▁world")
    monkeypatch.setattr(cli, "_load_for_inference", lambda args, **kwargs: (config, None, None))
    monkeypatch.setattr(cli, "generate", lambda *args, **kwargs: [world, world])
    capsys.readouterr()
    assert cli.main(["generate", "--run-dir", str(run_dir), "--prompt", "Hello"]) == 0
    assert capsys.readouterr().out == "Hello world world\n"


def test_fine_tune_from_a_hugging_face_checkpoint(tmp_path, capsys):
    import json

    import numpy as np

    fixture = Path(__file__).parent / "fixtures" / "hf" / "mixtral"
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 128, 20_000).astype(np.int32))
    run_dir = tmp_path / "run"
    result = run_cli("train", "--init-from-hf", str(fixture), "--data", str(tokens), "--steps", "2",
                     "--run-dir", str(run_dir), "--no-progress", "train.batch_size=8", "train.seq_len=16",
                     "train.eval_batches=1", "train.log_every=1", "train.dtype=float32", "train.plot=false",
                     one_device=True)
    assert result.returncode == 0, result.stderr
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["model"]["family"] == "mixtral" and saved["model"]["hidden_size"] == 32
    assert saved["train"]["seq_len"] == 16  # the run's own settings apply on top of the imported model
    assert_one_line(*run_main(capsys, "generate", "--hf-dir", str(fixture), "--prompt", "x"), "tokenizer.json")


def test_generate_from_a_hugging_face_directory_builds_the_bf16_weights_a_run_casts_after_restoring(tmp_path,
                                                                                                 monkeypatch, capsys):
    """Where generation runs in bf16 (a GPU), `generate --hf-dir` builds every matrix but the routers' in bf16 on the
    host, without a float32 copy; they are bit for bit the weights `generate --run-dir` casts from the imported
    run's float32 checkpoint, and decode the same tokens."""
    import shutil

    import jax
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dropless.convert import convert_from_hf
    from dropless.models import transformer

    hf_dir = tmp_path / "hf"
    shutil.copytree(Path(__file__).parent / "fixtures" / "hf" / "mixtral", hf_dir)
    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(100))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    convert_from_hf(hf_dir, tmp_path / "run")
    monkeypatch.setattr(cli, "generation_config", lambda config: config.replace(**{"train.dtype": "bfloat16"}))
    loaded, real_load = [], cli.load_hf
    monkeypatch.setattr(cli, "load_hf", lambda *args, **kwargs: loaded.append(real_load(*args, **kwargs)) or loaded[-1])
    seen, real = [], cli.generate
    monkeypatch.setattr(cli, "generate", lambda config, params, *args, **kwargs: seen.append(params)
                        or real(config, params, *args, **kwargs))
    printed = []
    for source in (["--hf-dir", str(hf_dir)], ["--run-dir", str(tmp_path / "run")]):
        capsys.readouterr()
        assert cli.main(["generate", *source, "--prompt", "w3 w7 w9", "--temperature", "0",
                         "--max-new-tokens", "5"]) == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and len(printed[0].split()) == 8
    from_hf, from_run = (jax.tree_util.tree_leaves_with_path(params) for params in seen)
    dtypes = set()
    for (path, a), (_, b) in zip(from_hf, from_run, strict=True):
        assert a.dtype == b.dtype, jax.tree_util.keystr(path)
        bits = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
        np.testing.assert_array_equal(np.asarray(a).view(bits), np.asarray(b).view(bits))
        dtypes.add((transformer.is_router_weight(path) or a.ndim < 2, str(a.dtype)))
    assert dtypes == {(True, "float32"), (False, "bfloat16")}
    ((_, params, _),) = loaded  # built in bf16, not cast after loading
    assert {str(x.dtype) for x in jax.tree.leaves(params["moe_layers"]["moe"]["experts"])} == {"bfloat16"}
