"""Broken files and command lines given to `dropless`, in-process: one line on stderr, exit status 2, no traceback
(unless --debug or DROPLESS_DEBUG=1 asks for it); our own bugs keep theirs."""

from __future__ import annotations

import errno
import importlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless import cli
from dropless.bench import gmm, rates
from dropless.core import config as config_lib
from dropless.core.arguments import ArgumentParser
from dropless.core.config import ConfigError
from dropless.core.debug import DEBUG_ENV, debugging
from dropless.data import train_bpe
from dropless.models.generate import context_start
from dropless.train import checkpoint as ckpt
from dropless.train import loop, overwrite, run_lock
from tests.test_train import CORPUS, SMALL

SMALL_OVERRIDES = [f"{k}={v}" for k, v in SMALL.items()]


def run_main(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stderr) of `dropless ARGV`, run in this process."""
    try:
        status = cli.main(list(argv))
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code
    return status, capsys.readouterr().err


def assert_one_line(status: int, stderr: str, *fragments: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert status == 2, (status, stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("dropless: error:"), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> pathlib.Path:
    """Broken and sound inputs side by side: run directories (no checkpoints needed: every check comes first),
    token arrays, tokenizers."""
    root = tmp_path_factory.mktemp("broken")
    saved = json.dumps(config_lib.load_preset("tiny").replace(**SMALL).to_dict(), indent=2)
    for name, text in {"run": saved, "torn": saved[:100], "listed": "[1, 2]", "binary": None}.items():
        (root / name).mkdir()
        if text is None:
            (root / name / "config.json").write_bytes(b"\xff\xfe\x00garbage")
        else:
            (root / name / "config.json").write_text(text)
    train_bpe(["def f(x):\n    return x\n"] * 20, 300).save(root / "run" / "tokenizer.json")
    shutil.copytree(root / "run", root / "ckfile")
    (root / "ckfile" / "checkpoints").write_text("")  # a file where the run's checkpoints directory belongs
    (root / "tokenless").mkdir()  # a run trained on token ids: no tokenizer.json
    (root / "tokenless" / "config.json").write_text(saved)
    for name, group, key, value in (("choicelist", "moe", "gmm_backend", [1]),
                                    ("choicedict", "train", "dtype", {"a": 1})):
        (root / name).mkdir()
        broken = json.loads(saved)
        broken[group][key] = value
        (root / name / "config.json").write_text(json.dumps(broken))
    (root / "nogroup").mkdir()  # a config.json without its train group would resume on the default settings
    without_train = {group: keys for group, keys in json.loads(saved).items() if group != "train"}
    (root / "nogroup" / "config.json").write_text(json.dumps(without_train))
    (root / "badtok").mkdir()
    (root / "badtok" / "config.json").write_text(saved)
    (root / "badtok" / "tokenizer.json").write_text("garbage")
    (root / "bigtok").mkdir()  # a tokenizer whose merges reach ids beyond the model's 320 entries
    (root / "bigtok" / "config.json").write_text(saved)
    train_bpe([CORPUS], 2048).save(root / "bigtok" / "tokenizer.json")
    (root / "hfmodel").mkdir()
    (root / "hfmodel" / "config.json").write_text('{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}')
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text('{"model_type": "mixtral", ')
    os.mkfifo(root / "fifo.npy")  # nothing ever writes it: reading it would block for ever
    (root / "hfbig").mkdir()
    (root / "hfbig" / "config.json").write_text('{"model_type": "mixtral", "hidden_size": "big"}')
    (root / "empty.npy").write_bytes(b"")
    (root / "garbage.npy").write_text("not an array")
    (root / "list.json").write_text("[1, 2]")  # JSON, but not the record a command reads
    (root / "object.json").write_text('{"a": 1}')
    np.save(root / "zero.npy", np.zeros((0, 8), np.int32))
    np.save(root / "ok.npy", np.ones((1, 4), np.int32))
    (root / "adir").mkdir()
    (root / "chart.png").mkdir()  # where bench gmm --out chart.json draws its chart
    return root


@pytest.mark.parametrize("argv, fragments", [
    (["generate", "--run-dir", "{f}/torn", "--prompt", "x"], ["torn/config.json is not valid JSON", "restore"]),
    (["train", "--resume", "--run-dir", "{f}/torn"], ["torn/config.json is not valid JSON"]),
    (["train", "--resume", "--run-dir", "{f}/nogroup"], ["nogroup/config.json lacks the config group train,",
                                                         "cut short or edited by hand; restore it"]),
    (["generate", "--run-dir", "{f}/nogroup", "--prompt", "x"], ["nogroup/config.json lacks the config group train"]),
    (["eval", "--run-dir", "{f}/run", "--json", "{f}/adir"], ["--json", "adir is a directory"]),
    (["generate", "--run-dir", "{f}/listed", "--prompt", "x"], ["listed/config.json", "JSON object"]),
    (["convert", "--from", "{f}/binary", "--to-hf", "{f}/out"], ["binary/config.json is not a text file"]),
    (["generate", "--run-dir", "{f}/badtok", "--prompt", "x"], ["badtok/tokenizer.json is not a valid tokenizer"]),
    (["generate", "--run-dir", "{f}/bigtok", "--prompt", "return x * y + 123"],
     ["bigtok/tokenizer.json gives the prompt token id", "vocabulary has 320 entries"]),
    (["generate", "--hf-dir", "{f}/hf", "--prompt", "x"], ["hf/config.json is not valid JSON", "re-download"]),
    (["generate", "--hf-dir", "{f}/hfbig", "--prompt", "x"], ["config.json field hidden_size='big' is not an integer"]),
    (["generate", "--hf-dir", "{f}/run", "--prompt", "x"], ["run looks like a dropless run directory", "--run-dir"]),
    (["logits", "--hf-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", "{f}/o.npy"],
     ["run looks like a dropless run directory", "--run-dir"]),
    (["train", "--init-from-hf", "{f}/run", "--run-dir", "{f}/new11"],
     ["run looks like a dropless run directory", "dropless convert --from"]),
    (["convert", "--from-hf", "{f}/hfbig", "--to", "{f}/imported1"], ["hidden_size='big'", "re-download"]),
    (["convert", "--from-hf", "{f}/hf", "--to", "{f}/imported2", "--from", "{f}/run", "--to-hf", "{f}/exported"],
     ["one direction at a time", "not both"]),
    (["generate", "--run-dir", "{f}/ok.npy", "--prompt", "x"], ["ok.npy is not a dropless run directory"]),
    (["generate", "--run-dir", "{f}/ckfile", "--prompt", "x"], ["ckfile/checkpoints is a file, not a checkpoints"]),
    (["logits", "--run-dir", "{f}/ckfile", "--tokens", "{f}/ok.npy", "--out", "{f}/o.npy"],
     ["ckfile/checkpoints is a file, not a checkpoints directory", "move it out of the way"]),
    (["train", "--resume", "--run-dir", "{f}/ckfile"], ["ckfile/checkpoints is a file, not a checkpoints"]),
    (["convert", "--from", "{f}/ckfile", "--to-hf", "{f}/out3"], ["ckfile/checkpoints is a file, not a checkpoints"]),
    (["generate", "--run-dir", "{f}/hfmodel", "--prompt", "x"], ["hfmodel holds a Hugging Face model", "--hf-dir"]),
    (["convert", "--from", "{f}/hfmodel", "--to-hf", "{f}/out2"], ["hfmodel holds a Hugging Face model"]),
    (["generate", "--run-dir", "{f}/run", "--prompt", "x", "--temperature", "nan"],
     ["--temperature must be a finite number >= 0 and --top-p a number in (0, 1]"]),
    (["generate", "--run-dir", "{f}/run", "--prompt", "x", "--temperature", "inf"], ["--temperature must be a finite", "inf"]),
    (["generate", "--run-dir", "{f}/run", "--prompt", ""], ["The prompt holds no tokens"]),  # before the load
    (["generate", "--run-dir", "{f}/run", "--prompt", "x", "--speculative"],  # before the load
     ["Speculative decoding (--speculative", "model.mtp_layers=0"]),
    (["generate", "--run-dir", "{f}/run", "--prompt", "x", "--seed", str(2**64)],
     ["--seed=18446744073709551616 is out of range"]),
    (["generate", "--run-dir", "{f}/run", "--prompt", "x", "--max-new-tokens", "-1"], ["--max-new-tokens must be >= 0"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/empty.npy", "--out", "{f}/o.npy"], ["empty.npy is empty"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/garbage.npy", "--out", "{f}/o.npy"],
     ["garbage.npy is not an .npy file"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/zero.npy", "--out", "{f}/o.npy"],
     ["zero.npy holds no tokens", "(0, 8)"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/adir", "--out", "{f}/o.npy"], ["adir is a directory"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", "{f}/adir"], ["--out", "is a directory"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", "{f}/no/o.npy"], ["no/o.npy", "create it"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", "{f}/ok.npy/o.npy"],
     ["ok.npy/o.npy: ", "ok.npy is a file, not a directory"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", "{f}/ok.npy/sub/o"],
     ["ok.npy/sub/o: ", "ok.npy is a file, not a directory"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", "{f}/ok"], ["is the --tokens file"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", "/dev/null"],
     ["--out /dev/null is not a regular file"]),
    (["train", "--data", "{f}/empty.npy", "--run-dir", "{f}/new1", "--steps", "1"], ["empty.npy is empty"]),
    (["train", "--data", "{f}/garbage.npy", "--run-dir", "{f}/new2"], ["garbage.npy is not an .npy file"]),
    (["train", "--tokenizer", "{f}/adir", "--run-dir", "{f}/new3"], ["adir is a directory", "tokenizer.json"]),
    (["train", "--tokenizer", "/dev/null", "--run-dir", "{f}/new5"], ["/dev/null is not a regular file"]),
    (["train", "--data", "{f}/fifo.npy", "--run-dir", "{f}/new6"], ["fifo.npy is not a regular file"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/fifo.npy", "--out", "{f}/o.npy"],
     ["--tokens", "fifo.npy is not a regular file"]),
    (["train", "--tokenizer", "{f}/badtok/tokenizer.json", "--run-dir", "{f}/new4"], ["not a valid tokenizer"]),
    (["train", "--run-dir", "{f}/ok.npy"], ["--run-dir", "ok.npy is a file"]),
    (["train", "--resume", "--overwrite", "--run-dir", "{f}/run"], ["--resume", "--overwrite", "only one"]),
    (["train", "--resume", "--run-dir", "{f}/run", "--preset", "tiny"], ["differs from --preset tiny", "drop --preset"]),
    (["train", "--resume", "--run-dir", "{f}/run", "--init-from-hf", "{f}/hf"], ["--init-from-hf", "--resume"]),
    (["generate", "--run-dir", "{f}/tokenless", "--prompt", "x"],
     ["tokenless/tokenizer.json is missing: generation needs the tokenizer", "dropless logits --tokens"]),
    # an output that is one of the command's own inputs, refused before the input is replaced
    (["eval", "--run-dir", "{f}/run", "--data", "{f}/ok.npy", "--json", "{f}/ok.npy"], ["--json", "is the --data file"]),
    (["eval", "--run-dir", "{f}/run", "--tokenizer", "{f}/ok.npy", "--json", "{f}/ok.npy"],
     ["is the --tokenizer file", "would replace the input"]),
    (["plan", "--preset", "tiny", "--rates", "{f}/ok.npy", "--json", "{f}/ok.npy"], ["--json", "is the --rates file"]),
    (["bench", "gmm", "--shapes", "tiny", "--configs", "{f}/ok.npy", "--out", "{f}/ok.npy"],
     ["--out", "is the --configs file"]),
    # a flag and an override of the same setting that disagree: neither silently wins
    (["eval", "--run-dir", "{f}/run", "--data", "{f}/ok.npy", "data.source=other.npy"],
     ["--data", "and data.source=other.npy disagree"]),
    (["train", "--steps", "3", "--run-dir", "{f}/new11", "train.steps=4"], ["--steps 3 and train.steps=4 disagree"]),
    (["train", "--resume", "--run-dir", "{f}/run", "--data", "{f}/ok.npy", "data.source=stdlib"],
     ["ok.npy and data.source=stdlib disagree; give the setting once."]),
    # sizes, seeds and integers no model can use, refused before anything runs or is written
    (["train", "--run-dir", "{f}/new6", "model.dense_intermediate_size=0"],
     ["model.dense_intermediate_size=0 must be > 0"]),
    (["train", "--run-dir", "{f}/new7", "model.v_head_dim=0"], ["model.v_head_dim=0 must be > 0"]),
    (["train", "--run-dir", "{f}/new8", "data.shuffle_seed=-1"], ["data.shuffle_seed=-1 must be >= 0"]),
    (["train", "--run-dir", "{f}/new10", "data.source="], ["data.source is empty", "'stdlib'"]),
    (["train", "--run-dir", "{f}/new9", "model.hidden_size=100000000000000000000"],
     ["model.hidden_size=100000000000000000000 is out of range", "2147483647"]),
    (["train", "--resume", "--run-dir", "{f}/choicelist"],
     ["choicelist/config.json", "moe.gmm_backend=[1] is not valid"]),
    (["generate", "--run-dir", "{f}/choicedict", "--prompt", "x"],
     ["choicedict/config.json", "train.dtype={'a': 1} is not valid", "choose one of bfloat16, float32"]),
    # key=value after options is an override (here a misspelt one), not an unrecognized argument
    (["train", "--steps", "1", "--run-dir", "{f}/new5", "moe.gmm_backnd=xla"], ["Unknown config key 'moe.gmm_backnd'"]),
    (["train", "--bogus-flag"], ["unrecognized arguments: --bogus-flag", "'dropless train --help'"]),
    (["generate", "--run-dir", "{f}/run", "--prompt", "x", "a=1"], ["a=1", "'dropless generate --help'"]),
    (["trian"], ["invalid choice", "'dropless --help'"]),
    # the commands with parsers of their own
    (["plan", "--devices", "x"], ["argument --devices: invalid int value: 'x'", "'dropless plan --help'"]),
    (["bench", "gmm", "--bogus"], ["unrecognized arguments: --bogus", "'dropless bench gmm --help'"]),
    (["tune-gmm", "--workers", "many"], ["invalid int value: 'many'", "'dropless tune-gmm --help'"]),
    (["tune-gmm", "--shape", "1,2,3"], ["--shape '1,2,3' must be four positive integers M,K,N,G."]),
    (["bench", "gmm", "--shapes", "nope"], ["--shapes: nope not known; choose from"]),
    (["bench", "gmm", "--shapes", "tiny", "--backends", "xla,"], ["--backends: '' not known; choose from"]),
    (["bench", "gmm", "--shapes", ","], ["--shapes names no shape; choose from"]),
    (["bench", "scale", "--devices", "0,1"], ["--devices: 0 is not a number of devices"]),
    (["bench", "gmm", "--stages", "dsv3-e32", "--out", "{f}/gmm.json"],  # the default shape on a CPU is tiny
     ["--stages dsv3-e32: a model's size", "--shapes tiny (the default there)"]),
    (["bench", "gmm", "--shapes", "qwen3-down,tiny", "--out", "{f}/gmm.json"], ["--shapes qwen3-down: a model's size"]),
    (["bench", "rates", "--size", "full"], ["--size full measures a GPU's shapes", "use --size small"]),
    (["bench", "gmm", "--shapes", "tiny", "--batches", "0"], ["--batches 0 must be at least 1"]),
    (["bench", "step", "--preset", "tiny", "--steps", "0"], ["--steps 0 must be at least 1"]),
    (["bench", "step"], ["the plan does not fit", "usable of cpu's"]),  # the proxy, before anything is compiled
    (["bench", "step", "--preset", "tiny", "--ladder", "--rungs", "4", "--out", "{f}/ladder", *SMALL_OVERRIDES],
     ["no rung of the ladder ran (--rungs 4 on cpu"]),  # rung 4 needs a GPU's kernels
    (["bench", "step", "--preset", "tiny", "--ladder", "--budget", "-1"], ["--budget -1.0 must be"]),
    (["profile", "--preset", "deepseek-v3-proxy", "--out", "{f}/profile"], ["the plan does not fit"]),
    # An unset shell variable (`--run-dir "$RUN"`): never the current directory, the default or an earlier run.
    (["generate", "--hf-dir", "", "--prompt", "x"], ["argument --hf-dir: an empty path"]),
    (["train", "--resume", "--run-dir", " "], ["argument --run-dir: an empty path"]),
    (["convert", "--from", "", "--to-hf", "{f}/out"], ["argument --from: an empty path"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", ""], ["argument --out: an empty path"]),
    (["bench", "step", "--preset", "tiny", "--seconds", "nan"],
     ["--seconds nan must be a number of seconds, 0 or more"]),
    (["bench", "step", "--chart", "{f}/garbage.npy"], ["--chart", "is not a JSON record"]),
    (["bench", "step", "--chart", "{f}/list.json"], ["--chart", "list.json is not a JSON record"]),
    (["bench", "step", "--chart", "{f}/object.json"], ["--chart", "object.json is not a JSON record"]),
    (["bench", "step", "--ep-devices", "0"], ["--ep-devices 0 must be at least 1"]),
    (["bench", "step", "--compile-workers", "-1"], ["--compile-workers -1 must be at least 1"]),
    (["bench", "plan-accuracy", "--table", "{f}/garbage.npy"], ["--table", "is not a plan-accuracy record"]),
    (["bench", "plan-accuracy", "--table", "{f}/list.json"], ["--table", "is not a plan-accuracy record"]),
    (["bench", "plan-accuracy", "--table", "{f}/object.json"], ["--table", "is not a plan-accuracy record"]),
    (["bench", "plan-accuracy", "--budget", "nan"], ["--budget nan must be a number of seconds, above 0"]),
    (["bench", "plan-accuracy", "--set", "tiny", "--budget", "-1"], ["--budget -1.0 must be a number of seconds"]),
    (["bench", "plan-accuracy", "--set", "tiny", "--device", "nope"],  # before the compile process starts
     ["the rate table has no device 'nope'; choose one of"]),
    (["bench", "plan-accuracy", "--steps", "0"], ["--steps 0 must be at least 1"]),
    (["bench", "plan-accuracy", "--set", "tiny", "--out", "{f}/garbage.npy"],  # read before anything is measured
     ["--out", "garbage.npy is not a plan-accuracy record"]),
    (["bench", "plan-accuracy", "--set", "tiny", "--budget", "0.001"], ["the compile phase ran past --budget=0 s"]),
    (["bench", "plan-accuracy", "--warmup", "-1"], ["--warmup -1 must be at least 0"]),
    (["bench", "plan-accuracy", "--seconds", "nan"], ["--seconds nan must be a number of seconds, 0 or more"]),
    (["bench", "ep", "--preset", "tiny", "--devices", "1", "--tokens", "0", "--out", "{f}/ep0.json"],
     ["--tokens 0 must be at least 1"]),
    (["bench", "ep", "--preset", "tiny", "--devices", "1", "--tokens", "-5", "--out", "{f}/ep0.json"],
     ["--tokens -5 must be at least 1"]),
    (["bench", "ep", "--preset", "tiny", "--devices", "1", "--iters", "0", "--out", "{f}/ep0.json"],
     ["--iters 0 must be at least 1"]),
    (["bench", "ep", "--preset", "tiny", "--devices", "1", "--profile-iters", "0", "--out", "{f}/ep0.json"],
     ["--profile-iters 0 must be at least 1"]),
    (["bench", "scale", "--steps", "0"], ["--steps 0 must be at least 1"]),
    (["bench", "scale", "--seconds", "nan"], ["--seconds nan must be a number of seconds, 0 or more"]),
    (["bench", "gmm", "--shapes", "tiny", "--seed", "-1", "--out", "{f}/gmm-seed.json"],
     ["--seed -1 must be at least 0"]),
    (["tune-gmm", "--preset", "tiny", "--rows", "0"], ["--rows 0 must be at least 1"]),
    (["tune-gmm", "--preset", "tiny", "--workers", "0"], ["--workers 0 must be at least 1"]),
    (["tune-gmm", "--preset", "tiny", "--seed", "-1"], ["--seed -1 must be at least 0"]),
    (["bench", "step", "--preset", "tiny", "--compilation-cache", "{f}/ok.npy", *SMALL_OVERRIDES],
     ["--compilation-cache", "ok.npy is a file, not a directory"]),  # before compiling
    (["bench", "step", "--preset", "tiny", "--record", "{f}/adir", *SMALL_OVERRIDES],
     ["--record", "adir is a directory", "JSON file"]),  # before compiling, as the two below
    (["bench", "step", "--preset", "tiny", "--record", "{f}/ok.npy/step.json", *SMALL_OVERRIDES],
     ["--record", "ok.npy is a file, not a directory"]),
    (["bench", "step", "--preset", "tiny", "--record", "{f}/ok.npy/new/step.json", *SMALL_OVERRIDES],
     ["--record", "ok.npy is a file, not a directory"]),
    (["bench", "ep", "--devices", "0"], ["--devices 0 must be at least 1"]),
    (["bench", "ep", "--preset", "tiny", "--devices", "1", "--tokens", "300", "train.seq_len=256"],
     ["--tokens 300 must be a multiple of train.seq_len=256", "e.g. --tokens 256"]),
    (["tune-gmm", "--shape", "1024,64,64,0"], ["--shape '1024,64,64,0' must be four positive integers"]),
    (["bench", "plan-accuracy", "--part", "3/2"], ["--part '3/2' is not K/N"]),
    (["bench", "scale", "--devices", "one"], ["--devices 'one' must be comma-separated integers"]),
    (["bench", "scale", "--out", "{f}/scale.json"], ["the plan does not fit", "usable of cpu's"]),  # the proxy
    (["profile", "--bogus"], ["unrecognized arguments: --bogus", "'dropless profile --help'"]),
    (["profile", "--preset", "tiny", "--top", "-5", "--out", "{f}/profile1"], ["--top -5 must be at least 1: the number of costliest"]),
    (["profile", "--preset", "tiny", "--top", "0", "--out", "{f}/profile2"], ["--top 0 must be at least 1"]),
    (["profile", "--preset", "tiny", "--out", "{f}/run"], ["--out", "holds a run"]),
    # Bytes that are not UTF-8 (Python keeps them as lone surrogates): no tokenizer or checkpoint writer takes them.
    (["generate", "--run-dir", "{f}/run", "--prompt", "a\udcffb"],
     ["argument --prompt: a prompt that is not UTF-8 text (byte 0xff)"]),
    (["train", "--run-dir", "{f}/r\udcff", *SMALL_OVERRIDES], ["argument --run-dir: a path that is not UTF-8 text"]),
    # A command's result written over a model directory's own files would break the run or the model.
    (["eval", "--run-dir", "{f}/run", "--json", "{f}/run/config.json"],
     ["--json", "names a file of the model directory"]),
    (["plan", "--preset", "tiny", "--json", "{f}/run/metrics.jsonl"],
     ["--json", "names a file of the model directory"]),
    (["logits", "--run-dir", "{f}/run", "--tokens", "{f}/ok.npy", "--out", "{f}/hfmodel/model.safetensors"],
     ["--out", "names a file of the model directory"]),
])
def test_broken_input_gives_one_line(capsys, files, argv, fragments):
    status, stderr = run_main(capsys, *(a.replace("{f}", str(files)) for a in argv))
    assert_one_line(status, stderr, *fragments)
    assert "dropless dropless" not in stderr


def measured(*args, **kwargs):
    raise AssertionError("measured: the output path was not checked first")


# The output each command writes only after minutes of compiling and timing, refused before anything is measured:
# the measuring function fails the test if it is called.
@pytest.mark.parametrize("argv, measuring, fragments", [
    (["bench", "step", "--preset", "tiny", "--record", "{f}/adir", *SMALL_OVERRIDES], "step.compile_variants",
     ["--record", "adir is a directory", "JSON file"]),
    (["bench", "step", "--preset", "tiny", "--ladder", "--out", "{f}/ok.npy"], "step.run_ladder",
     ["--out", "ok.npy is a file, not a directory", "a directory, new or existing"]),
    (["bench", "step", "--preset", "tiny", "--ladder", "--out", "{f}/ladder2", "--traces", "{f}/ok.npy/traces"],
     "step.run_ladder", ["--traces", "ok.npy is a file, not a directory"]),
    (["bench", "gmm", "--shapes", "tiny", "--out", "{f}/adir"], "gmm.bench_shape",
     ["--out", "adir is a directory", "JSON file"]),
    (["bench", "gmm", "--shapes", "tiny", "--out", "{f}/ok.npy/gmm-{device}.json"], "gmm.bench_shape",
     ["--out", "ok.npy/gmm-cpu.json: ", "ok.npy is a file, not a directory", "inside a directory"]),
    (["bench", "gmm", "--shapes", "tiny", "--out", "{f}/chart.json"], "gmm.bench_shape",
     ["--chart", "chart.png is a directory", "PNG file"]),  # the chart's default path: beside --out
    (["bench", "gmm", "--shapes", "tiny", "--out", "{f}/gmm/g.json", "--chart", "{f}/ok.npy/g.png"],
     "gmm.bench_shape", ["--chart", "ok.npy is a file, not a directory"]),
    (["bench", "scale", "--preset", "tiny", "--devices", "1,2", "--out", "{f}/adir"], "scale.compile_variants",
     ["--out", "adir is a directory"]),
    (["bench", "scale", "--preset", "tiny", "--devices", "1,2", "--out", "{f}/ok.npy/new/scale.json"],
     "scale.compile_variants", ["--out", "ok.npy is a file, not a directory"]),
    (["bench", "ep", "--preset", "tiny", "--out", "{f}/adir"], "ep.measure", ["--out", "adir is a directory"]),
    (["bench", "ep", "--preset", "tiny", "--out", "{f}/ep.json", "--traces", "{f}/ok.npy"], "ep.measure",
     ["--traces", "ok.npy is a file, not a directory"]),
    (["bench", "rates", "--size", "small", "--out", "{f}/adir"], "rates.measure", ["--out", "adir is a directory"]),
    (["bench", "rates", "--size", "small", "--out", "{f}/ok.npy/rates.json"], "rates.measure",
     ["--out", "ok.npy is a file, not a directory"]),
    (["tune-gmm", "--shape", "1024,64,64,4", "--out", "{f}/adir"], "tune_gmm.tune_shape",
     ["--out", "adir is a directory"]),  # before the GPU is looked for, as the one below
    (["tune-gmm", "--shape", "1024,64,64,4", "--out", "{f}/t.json", "--log", "{f}/ok.npy/log.json"],
     "tune_gmm.tune_shape", ["--log", "ok.npy is a file, not a directory"]),
    (["bench", "plan-accuracy", "--set", "tiny", "--out", "{f}/adir"], "plan_accuracy.run",
     ["--out", "adir is a directory"]),
    (["bench", "plan-accuracy", "--set", "tiny", "--out", "{f}/ok.npy/pa.json"], "plan_accuracy.run",
     ["--out", "ok.npy is a file, not a directory"]),
    (["plan", "--preset", "tiny", "--compiled", "--json", "{f}/adir"], "plan.make_plan",
     ["--json", "adir is a directory"]),
    (["profile", "--preset", "tiny", "--out", "{f}/ok.npy"], "harness.build",
     ["--out", "ok.npy is a file, not a directory", "a directory, new or existing"]),
    (["profile", "--preset", "tiny", "--out", "{f}/ok.npy/new"], "harness.build",
     ["--out", "ok.npy/new: ", "ok.npy is a file, not a directory"]),
])
def test_an_unusable_output_is_refused_before_measuring(capsys, files, monkeypatch, argv, measuring, fragments):
    monkeypatch.setattr(f"dropless.bench.{measuring}", measured)
    before = set(files.rglob("*"))
    status, stderr = run_main(capsys, *(a.replace("{f}", str(files)) for a in argv))
    assert_one_line(status, stderr, *fragments)
    assert set(files.rglob("*")) == before  # nothing made for the refused command, not even an empty folder


def test_on_a_cpu_the_benchmarks_default_to_their_cpu_sizes(tmp_path, monkeypatch):
    """`bench gmm` and `bench rates` without a size measure the tiny shape and the small sizes on a CPU, where
    their GPU defaults would take hours and more memory than the host has."""
    seen = []
    monkeypatch.setattr(gmm, "bench_shape", lambda spec, *args, **kwargs: seen.append(spec.name) or [])
    monkeypatch.setattr(rates, "measure", lambda size: seen.append(size) or measured())
    assert gmm.main(["--out", str(tmp_path / "gmm.json")]) == 0
    with pytest.raises(AssertionError, match="measured"):
        rates.main([])
    assert seen == ["tiny", "small"]


@pytest.mark.parametrize("argv, measuring", [
    (["bench", "gmm", "--shapes", "tiny", "--out", "{f}/new1/gmm-{device}.json", "--chart", "{f}/new2/g.png"],
     "gmm.bench_shape"),
    (["bench", "scale", "--preset", "tiny", "--devices", "1,2", "--out", "{f}/new3/scale.json"],
     "scale.compile_variants"),
    (["bench", "ep", "--preset", "tiny", "--out", "{f}/new4/ep.json", "--traces", "{f}/new5"], "ep.measure"),
    (["bench", "rates", "--size", "small", "--out", "{f}/new6/rates.json"], "rates.measure"),
    (["bench", "plan-accuracy", "--set", "tiny", "--out", "{f}/new7/pa.json"], "plan_accuracy.run"),
    (["plan", "--preset", "tiny", "--json", "{f}/new8/plan.json"], "plan.make_plan"),
    (["tune-gmm", "--shape", "1024,64,64,4", "--out", "{f}/new9/deeper/t.json"], "tune_gmm.tune_shape"),
])
def test_an_output_folder_not_made_yet_is_no_reason_to_refuse(files, monkeypatch, argv, measuring):
    """The benchmarks create the folders they write into: a new one passes the check and the measurement starts."""
    monkeypatch.setattr(f"dropless.bench.{measuring}", measured)
    if argv[0] == "tune-gmm":  # it measures GPU kernels only: the check under test comes after that one
        from dropless.bench import records
        monkeypatch.setattr("dropless.bench.tune_gmm.environment", lambda: {**records.environment(), "platform": "gpu"})
    with pytest.raises(AssertionError, match="measured"):
        cli.main([a.replace("{f}", str(files)) for a in argv])


def test_a_prompt_longer_than_the_context_window_is_named_before_the_model_loads(capsys, files):
    """The run has no checkpoint, so the load fails after the note: the note comes first, from the saved config."""
    status, stderr = run_main(capsys, "generate", "--run-dir", str(files / "run"), "--prompt", "return x\n" * 40)
    lines = stderr.splitlines()
    assert status == 2 and len(lines) == 2, stderr
    seen = re.match(r"dropless: the prompt is (\d+) tokens and the model sees the last (\d+) of them \(its "
                    r"context, model.max_seq_len=32, moves on in steps of half of it\)\.$", lines[0])
    prompt, shown = (int(seen[1]), int(seen[2])) if seen else (0, 0)
    assert seen and shown == prompt - context_start(prompt, 32) and 16 <= shown <= 32, lines[0]
    assert lines[1].startswith("dropless: error:"), lines[1]


def test_a_refused_config_writes_no_run_directory(capsys, files):
    for number, override in enumerate(["model.v_head_dim=0", "data.shuffle_seed=-1",
                                      "model.hidden_size=100000000000000000000", "data.source="]):
        status, stderr = run_main(capsys, "train", "--run-dir", str(files / f"refused{number}"), override)
        assert_one_line(status, stderr, override.partition("=")[0])
        assert not (files / f"refused{number}").exists()


def test_debug_shows_the_traceback_of_a_user_error(capsys, files, monkeypatch):
    argv = ["generate", "--run-dir", str(files / "torn"), "--prompt", "x"]
    for extra, env in (([cli.DEBUG_FLAG], None), ([], "1")):
        if env is not None:
            monkeypatch.setenv("DROPLESS_DEBUG", env)
        status, stderr = run_main(capsys, *argv, *extra)
        assert status == 2 and "Traceback" in stderr and "JSONDecodeError" in stderr, stderr
        assert stderr.strip().splitlines()[-1].startswith("dropless: error:")


def test_an_unwritable_run_directory_gives_one_line(capsys, files, monkeypatch):
    locked = files / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: make the directory refuse as the OS would
        original = pathlib.Path.mkdir

        def refuse(self, *args, **kwargs):
            if locked in self.parents:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    status, stderr = run_main(capsys, "train", "--run-dir", str(locked / "run"), *SMALL_OVERRIDES)
    locked.chmod(0o700)
    assert_one_line(status, stderr, f"{locked / 'run'}: permission denied", "check its permissions")


def test_overrides_stand_anywhere_among_the_options():
    args = cli.parse_args(["train", "a.b=1", "--steps", "20", "--run-dir", "X", "train.checkpoint_every=5",
                           "--no-progress", "c.d=2"])
    assert args.overrides == ["a.b=1", "train.checkpoint_every=5", "c.d=2"]
    assert (args.steps, args.run_dir, args.no_progress) == (20, "X", True)
    args = cli.parse_args(["eval", "--run-dir", "R", "train.batch_size=8", "--max-sequences", "8", "train.remat=full"])
    assert (args.overrides, args.max_sequences) == (["train.batch_size=8", "train.remat=full"], 8)



class _Parsed(Exception):
    pass


@pytest.mark.parametrize("module", ["plan", "step", "ep", "scale", "profile"])
def test_overrides_stand_anywhere_among_the_options_of_plan_and_bench(module, monkeypatch):
    """Each command's main reads its line with overrides between the options (stopped once it is parsed)."""
    bench = importlib.import_module(f"dropless.bench.{module}")
    parser = bench._parser()
    parse = parser.parse_intermixed_args

    def parse_and_stop(argv):
        raise _Parsed(parse(argv))

    parser.parse_intermixed_args = parse_and_stop
    monkeypatch.setattr(bench, "_parser", lambda: parser)
    with pytest.raises(_Parsed) as parsed:
        bench.main(["a.b=1", "--preset", "tiny", "c.d=2"])
    assert (parsed.value.args[0].overrides, parsed.value.args[0].preset) == (["a.b=1", "c.d=2"], "tiny")


def test_the_same_preset_on_resume_is_accepted(files):
    args = cli.parse_args(["train", "--resume", "--run-dir", str(files / "run"), "--preset", "tiny", *SMALL_OVERRIDES])
    saved = config_lib.load(files / "run" / "config.json")
    cli._check_preset_matches("tiny", saved, config_lib.parse_overrides(args.overrides), args, files / "run")


def test_our_own_bugs_keep_their_traceback_and_errors_may_carry_a_status(capsys, monkeypatch):
    def bug(args):
        raise ValueError("a bug in dropless")

    monkeypatch.setattr(cli, "cmd_presets", bug)
    with pytest.raises(ValueError, match="a bug in dropless"):
        cli.main(["presets"])
    stopped = type("Stopped", (ConfigError,), {"exit_status": 75, "__module__": "dropless.train.loop"})

    def stop(args):
        raise stopped("The run stopped at step 3; resume it with --resume.")

    monkeypatch.setattr(cli, "cmd_presets", stop)
    assert cli.main(["presets"]) == 75
    assert capsys.readouterr().err == "dropless: error: The run stopped at step 3; resume it with --resume.\n"


def test_a_new_run_that_fails_before_its_first_step_leaves_its_directory_as_it_found_it(capsys, tmp_path, monkeypatch):
    """A wrong --data, or a setting the step cannot take: a run directory the command made is gone, an empty one
    given stays empty (but for the lock), so the corrected command, with any config, needs no --overwrite; a default
    runs/<preset>-* goes too."""
    data, run_dir = tmp_path / "tokens.npy", tmp_path / "run"
    data.write_bytes(b"")
    command = ["train", "--data", str(data), "--run-dir", str(run_dir), "--steps", "1", *SMALL_OVERRIDES]
    assert_one_line(*run_main(capsys, *command), "tokens.npy is empty")
    assert not run_dir.exists()
    run_dir.mkdir()
    assert_one_line(*run_main(capsys, *command, "train.seed=7"), "tokens.npy is empty")
    assert [p.name for p in run_dir.iterdir()] == [".lock"]
    monkeypatch.chdir(tmp_path)
    assert_one_line(*run_main(capsys, "train", "--data", str(data), "--steps", "1", *SMALL_OVERRIDES),
                    "tokens.npy is empty")
    assert list((tmp_path / "runs").iterdir()) == []  # the default directory made for the run is gone
    # A setting the step cannot take, found once the data has loaded: the same.
    np.save(data, np.arange(4000, dtype=np.int32) % 320)
    assert_one_line(*run_main(capsys, *command, "moe.gmm_backend=dropless_mosaic"), "needs an NVIDIA GPU")
    assert [p.name for p in run_dir.iterdir()] == [".lock"]


def test_an_imported_run_is_refused_for_training_in_place_before_its_data_is_read(capsys, tmp_path, monkeypatch):
    """`convert --from-hf` makes a run of weights only: --resume and a plain start there are refused in one line
    naming --init-from-hf, before the corpus is read; --overwrite replaces it."""
    fixture = pathlib.Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3"
    run_dir = tmp_path / "imported"
    assert cli.main(["convert", "--from-hf", str(fixture), "--to", str(run_dir)]) == 0
    monkeypatch.setattr(loop, "load_token_dataset", measured)
    for extra in (["--resume"], []):
        assert_one_line(*run_main(capsys, "train", "--run-dir", str(run_dir), "--steps", "1", *extra),
                        "holds weights imported from Hugging Face", "--init-from-hf HF_DIR", "--overwrite")
    assert ckpt.imported(run_dir)
    with pytest.raises(AssertionError, match="measured"):  # replaced: the new run goes on to read its data
        cli.main(["train", "--run-dir", str(run_dir), "--steps", "1", "--overwrite", *SMALL_OVERRIDES])
    assert ckpt.imported(run_dir)  # the new run never had its data: the imported one is put back


def test_logits_refuses_tokens_the_model_cannot_take(capsys, tmp_path):
    """Ids beyond the vocabulary and rows longer than model.max_seq_len (the fixture's 256, as `generate` keeps
    its context), each in one line; a row of exactly that length runs."""
    fixture = str(pathlib.Path(__file__).parent / "fixtures" / "hf" / "deepseek_v3")
    cases = {"big": (np.full((1, 4), 256, np.int32), ["--tokens holds ids outside [0, 256)"]),
             "long": (np.ones((1, 257), np.int32), ["sequences of 257 tokens", "(256, model.max_seq_len)"])}
    for name, (tokens, fragments) in cases.items():
        np.save(tmp_path / f"{name}.npy", tokens)
        assert_one_line(*run_main(capsys, "logits", "--hf-dir", fixture, "--tokens", str(tmp_path / f"{name}.npy"),
                                  "--out", str(tmp_path / "out.npy")), *fragments)
    assert not (tmp_path / "out.npy").exists()
    np.save(tmp_path / "full.npy", np.ones((1, 256), np.int32))
    assert cli.main(["logits", "--hf-dir", fixture, "--tokens", str(tmp_path / "full.npy"),
                     "--out", str(tmp_path / "out.npy")]) == 0
    assert np.load(tmp_path / "out.npy").shape == (1, 256, 256)


def test_resume_without_a_run_dir_continues_the_newest_run_with_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="--resume found no earlier 'tiny' run under runs/; pass --run-dir DIR"):
        cli._default_run_dir("tiny", resume=True)
    for name in ("tiny-20261201-100000", "tiny-20261202-100000", "tiny-20261203-100000", "other-20261204-100000"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    assert cli._default_run_dir("tiny", resume=True) == pathlib.Path("runs/tiny-20261203-100000")  # none has one
    (tmp_path / "runs" / "tiny-20261202-100000" / "checkpoints" / "5").mkdir(parents=True)
    assert cli._default_run_dir("tiny", resume=True) == pathlib.Path("runs/tiny-20261202-100000")


def test_a_refused_start_in_a_directory_of_the_user_s_own_deletes_none_of_their_files(capsys, tmp_path):
    """A directory the user made, with their own files in it: refused in one line, and their files all stay, one
    named like a temporary file (NAME.<number>.tmp) included; only the temporaries of a run's own files go."""
    run_dir = tmp_path / "mine"
    (run_dir / "corpus").mkdir(parents=True)
    for name in ("notes.txt", "draft.2024.tmp", "corpus/words.1.tmp"):
        (run_dir / name).write_text("the user's")
    for name in ("config.json.123.tmp", "corpus/tokens-0123.npz.123.tmp"):  # a killed run's
        (run_dir / name).write_text("half")
    assert_one_line(*run_main(capsys, "train", "--run-dir", str(run_dir), *SMALL_OVERRIDES),
                    "holds no run (no config.json)", "--overwrite to start a run there beside its files")
    theirs = [".lock", "corpus/words.1.tmp", "draft.2024.tmp", "notes.txt"]
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()) == theirs
    # --overwrite starts a run beside them: they stay when the new run's first checkpoint discards what it set aside.
    config = config_lib.load_preset("tiny").replace(**SMALL)
    loop.prepare_run_dir(run_dir, config, resume=False, overwrite=True)
    overwrite.discard(run_dir)
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()) == sorted(
        theirs + ["config.json"])


def test_a_run_never_starts_over_a_config_json_no_run_wrote(capsys, tmp_path):
    """A Hugging Face model's directory, and one holding another program's config.json: `train` there is refused in
    one line, with --overwrite too (it replaces runs only), and every file stays as it was. A directory where the
    run's plot goes, and a file where one of its directories goes, are named before any step, not after the
    last (or as an OS error about a path the user never chose)."""
    hf, own, plotted = tmp_path / "hf", tmp_path / "own", tmp_path / "plotted"
    for directory, text in ((hf, '{"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}'),
                            (own, '{"name": "my project"}')):
        directory.mkdir()
        (directory / "config.json").write_text(text)
        (directory / "tokenizer.json").write_text("theirs")
    (plotted / "training.png").mkdir(parents=True)
    in_the_way = {name: tmp_path / name for name in ("tensorboard", "corpus", "checkpoints.damaged")}
    for name, directory in in_the_way.items():
        directory.mkdir()
        (directory / name).write_text("a file of the user's")
    for directory, extra, fragments in (
            *((directory, [], [f"{name} is a file where the run's {what} goes; move it away."])
              for (name, directory), what in zip(in_the_way.items(), ("TensorBoard directory", "token cache",
                                                                      "directory for damaged checkpoints"))),
            (hf, ["--overwrite"], ["holds a Hugging Face model, not a dropless run", "--overwrite replaces runs only"]),
            (own, [], ["config.json is not a dropless run's config", "choose another --run-dir"]),
            (own, ["--overwrite"], ["config.json is not a dropless run's config", "--overwrite replaces runs only"]),
            (plotted, [], ["training.png is a directory where the run's plot goes", "train.plot=false"])):
        contents = lambda: {p: p.read_bytes() for p in directory.rglob("*") if p.is_file() and p.name != ".lock"}
        before = contents()
        assert_one_line(*run_main(capsys, "train", "--run-dir", str(directory), "--steps", "1", *extra,
                                  *SMALL_OVERRIDES), *fragments)
        assert contents() == before
    # Without --overwrite the Hugging Face model's directory keeps the advice of how to use it.
    assert_one_line(*run_main(capsys, "train", "--run-dir", str(hf), *SMALL_OVERRIDES),
                    "holds a Hugging Face model", "--hf-dir")


def test_resume_without_a_run_dir_takes_no_copy_of_a_run_for_the_newest(tmp_path, monkeypatch):
    """A copy kept beside a run under another name (`cp -r runs/tiny-X runs/tiny-X.bak`) sorts after it by name,
    but `train` never made it: --resume continues the newest run `train` named, not the copy."""
    monkeypatch.chdir(tmp_path)
    for name in ("tiny-20261201-100000", "tiny-20261201-100000.bak", "tiny-backup"):
        (tmp_path / "runs" / name / "checkpoints" / "5").mkdir(parents=True)
    assert cli._default_run_dir("tiny", resume=True) == pathlib.Path("runs/tiny-20261201-100000")


def test_resume_without_a_run_dir_counts_a_run_an_interrupted_overwrite_set_aside(tmp_path, monkeypatch):
    """The newest run, whose --overwrite was killed before the new run's first checkpoint, holds its checkpoints in
    `.replaced` until the next start puts them back: it is still the run `--resume` continues, not an older one."""
    monkeypatch.chdir(tmp_path)
    for name in ("tiny-20261201-100000", "tiny-20261202-100000"):
        (tmp_path / "runs" / name / "checkpoints" / "5").mkdir(parents=True)
    newest = tmp_path / "runs" / "tiny-20261202-100000"
    overwrite.set_aside(newest)
    config_lib.save(config_lib.load_preset("tiny").replace(**SMALL), newest / "config.json")  # the new run's
    assert cli._default_run_dir("tiny", resume=True) == pathlib.Path("runs/tiny-20261202-100000")


def test_resume_after_an_interrupted_overwrite_continues_the_run_set_aside(capsys, tmp_path, monkeypatch):
    """Killed before its first checkpoint, an overwrite leaves its own config.json in place of the old run's, which
    waits in `.replaced`: `train --resume` (no overrides) continues the old run with the old run's config, instead of
    refusing the new run's settings as overrides the user never gave."""
    old = config_lib.load_preset("tiny").replace(**SMALL)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "5").mkdir(parents=True)
    config_lib.save(old, run_dir / "config.json")
    overwrite.set_aside(run_dir)
    config_lib.save(old.replace(**{"train.seed": 7}), run_dir / "config.json")  # the killed new run's
    monkeypatch.setattr(loop, "load_token_dataset", measured)
    with pytest.raises(AssertionError, match="measured"):  # past every check: the old run goes on to read its data
        cli.main(["train", "--run-dir", str(run_dir), "--resume", "--no-progress"])
    assert config_lib.load(run_dir / "config.json").train.seed == old.train.seed
    assert not (run_dir / ".replaced").exists() and (run_dir / "checkpoints" / "5").is_dir()


def test_reading_a_run_an_interrupted_overwrite_set_aside_says_where_it_is(capsys, tmp_path):
    """`generate` and `convert --from` on a run whose --overwrite was killed before the new run's first checkpoint: not "no finished
    checkpoint yet" (the run's checkpoints wait aside), but how to put it back; nothing is moved."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "5").mkdir(parents=True)
    config_lib.save(config_lib.load_preset("tiny").replace(**SMALL), run_dir / "config.json")
    train_bpe(["def f(x):\n    return x\n" * 50], SMALL["model.vocab_size"]).save(run_dir / "tokenizer.json")
    overwrite.set_aside(run_dir)
    config_lib.save(config_lib.load_preset("tiny").replace(**SMALL), run_dir / "config.json")  # the new run's
    assert_one_line(*run_main(capsys, "generate", "--run-dir", str(run_dir), "--prompt", "x"),
                    "set aside by an --overwrite", f"dropless train --run-dir {run_dir} --resume")
    assert_one_line(*run_main(capsys, "convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "hf")),
                    "set aside by an --overwrite", f"dropless train --run-dir {run_dir} --resume")
    assert (run_dir / ".replaced" / "checkpoints" / "5").is_dir() and not (tmp_path / "hf").exists()


def test_reading_a_run_an_overwrite_in_progress_set_aside_names_that_process(capsys, tmp_path):
    """`generate` and `convert --from` while `train --overwrite` runs in the run directory, before its first
    checkpoint: not "an --overwrite stopped" with a `--resume` to run (that trainer holds the lock, and its first
    checkpoint discards the old run), but the live process and to wait; nothing is moved."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "5").mkdir(parents=True)
    config_lib.save(config_lib.load_preset("tiny").replace(**SMALL), run_dir / "config.json")
    train_bpe(["def f(x):\n    return x\n" * 50], SMALL["model.vocab_size"]).save(run_dir / "tokenizer.json")
    with run_lock.hold(run_dir):  # the --overwrite trainer, between setting the old run aside and its checkpoint
        overwrite.set_aside(run_dir)
        config_lib.save(config_lib.load_preset("tiny").replace(**SMALL), run_dir / "config.json")
        for command in (["generate", "--run-dir", str(run_dir), "--prompt", "x"],
                        ["convert", "--from", str(run_dir), "--to-hf", str(tmp_path / "hf")]):
            status, err = run_main(capsys, *command)
            assert "stopped before" not in err and "--resume" not in err, err
            assert_one_line(status, err, f"being overwritten by dropless process {os.getpid()}", "first checkpoint")
    assert (run_dir / ".replaced" / "checkpoints" / "5").is_dir() and not (tmp_path / "hf").exists()


def test_a_run_that_failed_before_its_first_checkpoint_can_be_run_again(capsys, tmp_path):
    """A run that stopped in its first steps (its config.json written, no checkpoint): another command is told to
    pass --overwrite, and the same command starts the run from step 0. A run that reached a checkpoint is still
    refused."""
    data, run_dir = tmp_path / "tokens.npy", tmp_path / "run"
    np.save(data, np.arange(4000, dtype=np.int32) % 320)
    config = config_lib.build_config("tiny", config_lib.parse_overrides(SMALL_OVERRIDES), steps=1, data=str(data))
    loop.prepare_run_dir(run_dir, config, resume=False, overwrite=False)  # as a run killed in its first steps
    command = ["train", "--data", str(data), "--run-dir", str(run_dir), "--steps", "1", *SMALL_OVERRIDES]
    assert_one_line(*run_main(capsys, *command, "train.seed=7"),
                    "never reached its first checkpoint", "train.seed", "pass --overwrite")
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 5.0}\n')  # as a run killed early leaves
    lines = []
    prepared = loop.prepare_run_dir(run_dir, config, resume=False, overwrite=False, log=lines.append)
    assert prepared == config.replace(**{"train.schedule_steps": 1}) and not (run_dir / "metrics.jsonl").exists()
    assert lines == [f"dropless: {run_dir} holds this run, which never reached its first checkpoint; starting it "
                     "again from step 0"], lines
    overwrite.discard(run_dir)  # as train does at the new run's first checkpoint
    (run_dir / "checkpoints" / "1").mkdir(parents=True)  # a finished checkpoint, as orbax names it
    with pytest.raises(ConfigError, match="already holds a run; pass --resume"):
        loop.prepare_run_dir(run_dir, config, resume=False, overwrite=False)


def test_orbax_notes_on_a_checkpoint_metadata_file_stay_out_of_the_output(tmp_path, caplog, monkeypatch):
    """orbax logs an error per step whose optional metadata file it cannot parse; dropless keeps those out, for
    the command and for a library user alike (the checkpoint is verified by its digest, and a damaged one is
    reported in dropless's own line); DROPLESS_DEBUG (--debug) keeps them."""
    import logging

    from dropless.train import checkpoint as ckpt

    absl = logging.getLogger("absl")
    monkeypatch.setattr(absl, "filters", list(absl.filters))  # the filter the manager installs goes with the test
    note = ("Failed to json parse Metadata file: %s, file content: , error: Expecting value", "/run/checkpoints/30")
    logged = lambda: [r.getMessage() for r in caplog.records]
    with ckpt.manager(tmp_path / "run"):
        pass
    absl.error(*note)
    absl.error("Another orbax error")
    assert logged() == ["Another orbax error"]
    caplog.clear()
    monkeypatch.setenv("DROPLESS_DEBUG", "1")
    absl.error(*note)
    assert logged() == [note[0] % note[1]]


def test_writes_a_failed_step_left_pending_add_no_line_after_the_error():
    """A full disk can stop a run while orbax's asynchronous writes of the failed checkpoint are pending; the
    interpreter's shutdown then warns of each coroutine it never ran. The output ends with dropless's one line,
    as a new process shows (the warning is printed at exit, after main returns)."""
    script = """
import errno, sys
from dropless import cli

pending = []

async def write_fragment():
    pass

def full_disk(args):
    pending.append(write_fragment())  # started by the failing step, never awaited
    raise OSError(errno.ENOSPC, "No space left on device", "run/checkpoints")

cli.cmd_presets = full_disk
sys.exit(cli.main(["presets"]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dropless: error: run/checkpoints: "), done.stderr


def test_running_out_of_host_memory_gives_one_line(capsys, monkeypatch):
    def allocate(args):
        raise MemoryError("Unable to allocate 29.8 TiB for an array with shape (1000000000, 8193) and data type int32")

    monkeypatch.setattr(cli, "cmd_train", allocate)
    assert_one_line(*run_main(capsys, "train"), "out of host memory (unable to allocate 29.8 TiB",
                    "lower train.batch_size", "train.eval_batches")
    monkeypatch.setattr(cli, "cmd_presets", allocate)
    assert_one_line(*run_main(capsys, "presets"), "out of host memory", "free some memory")


def _allocate_too_much(*args, **kwargs):
    """A real XLA allocation larger than any machine's memory: XLA's own RESOURCE_EXHAUSTED error."""
    return jax.jit(lambda: jnp.ones((400_000, 1_000_000), jnp.float32))().block_until_ready()


def test_running_out_of_device_memory_gives_one_line(capsys, files, monkeypatch):
    config = config_lib.load(files / "run" / "config.json")
    monkeypatch.setattr(cli, "_load_for_inference", lambda args, **kwargs: (config, None, None))  # no checkpoint needed
    monkeypatch.setattr(cli, "compute_logits", _allocate_too_much)
    assert_one_line(*run_main(capsys, "logits", "--run-dir", str(files / "run"), "--tokens", str(files / "ok.npy"),
                              "--out", str(files / "oom.npy")),
                    "out of device memory (out of memory allocating 1600000000000 bytes)", "fewer or shorter rows")
    assert not (files / "oom.npy").exists()
    monkeypatch.setattr(cli, "cmd_train", _allocate_too_much)
    assert_one_line(*run_main(capsys, "train"), "out of device memory", "lower train.batch_size", "dropless plan")
    monkeypatch.setattr(cli, "cmd_presets", _allocate_too_much)
    assert_one_line(*run_main(capsys, "presets"), "out of device memory", "ask for less")


def test_other_runtime_errors_keep_their_traceback(monkeypatch):
    def failed(args):
        raise jax.errors.JaxRuntimeError("INTERNAL: a kernel failed")

    monkeypatch.setattr(cli, "cmd_presets", failed)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        cli.main(["presets"])


def test_ctrl_c_before_the_first_checkpoint_says_to_run_the_command_again(capsys, monkeypatch, tmp_path):
    """Ctrl-C outside the training loop (which turns SIGINT into a checkpoint itself): the advice fits whether or
    not the run has a checkpoint, since --resume is refused for a run without one."""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_train", interrupted)
    run_dir = tmp_path / "run"
    assert run_main(capsys, "train", "--run-dir", str(run_dir)) == (
        130, f"dropless: interrupted before {run_dir} had a checkpoint; run the same command again to start it "
             "from step 0.\n")
    (run_dir / "checkpoints" / "2").mkdir(parents=True)  # a finished checkpoint, as orbax names it
    assert run_main(capsys, "train", "--run-dir", str(run_dir)) == (
        130, f"dropless: interrupted; {run_dir}'s last finished checkpoint is intact (continue it with --resume).\n")
    assert run_main(capsys, "train")[1] == ("dropless: interrupted before the run's first checkpoint; run the same "
                                            "command again to start over.\n")
    monkeypatch.setattr(cli, "cmd_presets", interrupted)
    assert run_main(capsys, "presets") == (130, "dropless: interrupted.\n")


def test_a_reader_that_closes_the_pipe_ends_the_output_quietly():
    """`dropless presets | head -1`: no BrokenPipeError traceback, and the status of a command SIGPIPE ended."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-c", "import sys\nfrom dropless import cli\n"
                               "sys.exit(cli.main(['presets', '--keys']))"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, ""), done.stderr


def test_debug_reaches_a_benchmark_run_as_a_module(monkeypatch):
    """`python -m dropless.bench.scale --debug` (no `dropless` took the flag out): its parser sets DROPLESS_DEBUG,
    as `dropless --debug` does, so the details it promises are shown; without it nothing is set."""
    monkeypatch.setenv(DEBUG_ENV, "0")  # recorded, so that the test's end restores the variable as it was
    ArgumentParser(prog="dropless bench scale").parse_args([])
    assert not debugging()
    assert ArgumentParser(prog="dropless bench scale").parse_args(["--debug"]).debug
    assert debugging()


def test_init_from_hf_with_a_model_override_that_reshapes_the_weights_is_one_line(capsys, tmp_path):
    """model.* overrides apply on top of the checkpoint's config; one that changes a weight's shape is refused
    before the run directory is made, instead of training weights its config.json does not describe."""
    fixture = pathlib.Path(__file__).parent / "fixtures" / "hf" / "mixtral"
    assert_one_line(*run_main(capsys, "train", "--init-from-hf", str(fixture), "--run-dir", str(tmp_path / "run"),
                              "model.vocab_size=512"),
                    "The initial weights' params['embed'] has shape (128, 32), but this config's model has (512, 32)")
    assert not (tmp_path / "run").exists()


def _started(monkeypatch) -> list:
    """Stand in for the training loop: records the config `dropless train` would start it with."""
    import types

    seen = []
    monkeypatch.setattr(cli, "train", lambda config, run_dir, **kwargs: seen.append(config)
                        or types.SimpleNamespace(eval_losses=[]))
    return seen


def test_resume_applies_steps_data_and_tokenizer_flags_on_the_saved_config(tmp_path, monkeypatch):
    """`train --resume --steps N` extends a run: the flags apply on top of the run's saved config, like overrides
    (what a resume may change is then the loop's to decide: a --data or --tokenizer other than the run's is refused
    by name, below)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config_lib.save(config_lib.load_preset("tiny").replace(**SMALL), run_dir / "config.json")
    seen = _started(monkeypatch)
    assert cli.main(["train", "--run-dir", str(run_dir), "--resume", "--steps", "777", "--data", "more.txt",
                     "--tokenizer", "tok.json", "train.seed=5"]) == 0
    (config,) = seen
    assert (config.train.steps, config.data.source, config.data.tokenizer, config.train.seed) == \
           (777, "more.txt", "tok.json", 5)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"data.source differs .* drop that override \(--data or data.source=\)"):
        loop.prepare_run_dir(run_dir, config_lib.load(run_dir / "config.json").replace(**{"data.source": "more.txt"}),
                             resume=True, overwrite=False)


def test_init_from_hf_takes_the_model_from_the_checkpoint_and_training_settings_from_the_preset(tmp_path, monkeypatch):
    """--init-from-hf: the model is the checkpoint's; train/data/parallel come from --preset; the checkpoint's own
    tokenizer.json is used unless --tokenizer names another."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "tokenizer.json").write_text("{}")
    hf_config = config_lib.load_preset("tiny").replace(**{"model.num_layers": 3, "train.seed": 11, "train.warmup_steps": 3})
    monkeypatch.setattr(cli, "load_hf", lambda path: (hf_config, None, None))
    seen = _started(monkeypatch)
    preset = config_lib.load_preset("tiny")
    assert cli.main(["train", "--preset", "tiny", "--init-from-hf", str(hf_dir), "--run-dir", str(tmp_path / "r")]) == 0
    assert cli.main(["train", "--preset", "tiny", "--init-from-hf", str(hf_dir), "--run-dir", str(tmp_path / "r"),
                     "--tokenizer", "mine.json"]) == 0
    own, given = seen
    assert own.model == hf_config.model
    assert (own.train.seed, own.train.warmup_steps) == (preset.train.seed, preset.train.warmup_steps)
    assert own.data.tokenizer == str(hf_dir / "tokenizer.json") and given.data.tokenizer == "mine.json"
