"""The `dropless` command line: parse, build, call the library. Everything it does is importable.

User mistakes (bad flags, config keys, data, checkpoints, unreadable or missing files) end the process
with one line on stderr and exit status 2 (or the error's own `exit_status`), never a traceback; `--debug`
or DROPLESS_DEBUG=1 adds the traceback. Any other exception is our bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import errno
import gc
import importlib
import json
import logging
import os
import re
import signal
import sys
import traceback
import warnings
from pathlib import Path

import jax
import numpy as np

from dropless import convert
from dropless.convert import check_tokens, compute_logits, load_hf
from dropless.convert.api import read_hf_config
from dropless.core import config as config_lib
from dropless.core import distributed
from dropless.core.arguments import DEBUG_FLAG, ArgumentParser, check_output, path_text, utf8_text
from dropless.core.config import ConfigError, build_config, parse_overrides
from dropless.core.debug import DEBUG_ENV, debugging
from dropless.core.files import atomic_file, write_atomic
from dropless.data import DataError, load_token_array, load_token_dataset, load_token_stream, read_tokenizer_file
from dropless.data import resolve as resolve_corpus
from dropless.data import resolve_eos_id
from dropless.data.tokenizer import eos_token
from dropless.models import transformer
from dropless.models.generate import (check_prompt, check_sampling, check_speculative, context_start, generate,
                                      generation_config)
from dropless.train import checkpoint as ckpt
from dropless.train import overwrite as overwrite_lib
from dropless.train import setup as setup_lib
from dropless.train.evaluate import evaluate
from dropless.train.loop import resume_changes, train
from dropless.train.metrics import jsonable

DEFAULT_PRESET = "tiny"
# OS errors the user's files or machine cause, with the fix each sentence ends with (after the system's own
# description of the error, "Is a directory", "No space left on device", which the fix does not repeat).
OS_ERROR_FIXES = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "check the path (a part of it is a file)",
    errno.EISDIR: "give a file",
    errno.EACCES: "check its permissions or choose another location",
    errno.EPERM: "check its permissions or choose another location",
    errno.EROFS: "choose another location",
    errno.ENOSPC: "free some space or choose another location",
    errno.EDQUOT: "free some space or choose another location",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.EEXIST: "remove it or choose another path",
    errno.ENOTEMPTY: "remove it or choose another path",
}
# name: (module, what it measures), for 'dropless bench --help'
BENCHMARKS = {
    "gmm": ("dropless.bench.gmm", "grouped GEMMs beside the dense matmul and the other backends; whole expert stages"),
    "ep": ("dropless.bench.ep", "expert-parallel dispatch and combine, per strategy, over this machine's devices"),
    "step": ("dropless.bench.step", "the real training step, timed; and the optimisation ladder"),
    "scale": ("dropless.bench.scale", "weak scaling of the training step with expert parallelism, per strategy"),
    "rates": ("dropless.bench.rates", "the planner's rate table, measured on this device"),
    "plan-accuracy": ("dropless.bench.plan_accuracy", "the plan's predicted memory and step time against measured"),
}


def _default_run_dir(preset: str, resume: bool) -> Path:
    runs = Path("runs")
    if resume:
        # Only the names `train` gives (runs/<preset>-<date>-<time>), so sorting them sorts them by time: a copy
        # beside a run (runs/tiny-20260101-120000.bak, runs/tiny-backup) would sort after it and be the one resumed.
        existing = sorted(run for run in runs.glob(f"{preset}-*")
                          if re.fullmatch(r"\d{8}-\d{6}", run.name[len(preset) + 1:])) if runs.is_dir() else []
        if not existing:
            raise ConfigError(f"--resume found no earlier '{preset}' run under runs/; pass --run-dir DIR.")
        # The newest that holds a checkpoint: a later run that stopped before its first is nothing to resume.
        # A run an interrupted --overwrite set aside counts: the next start there puts it back.
        return next((run for run in reversed(existing) if overwrite_lib.reaches_a_checkpoint(run)), existing[-1])
    return runs / f"{preset}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def cmd_train(args) -> int:
    overrides = parse_overrides(args.overrides)
    if args.resume and args.overwrite:
        raise ConfigError("--resume continues the run in --run-dir and --overwrite replaces it; pass only one.")
    preset = args.preset or DEFAULT_PRESET
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(preset, args.resume)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file; give a directory (new or holding a run).")
    init_weights = None
    # The run's config as the start will find it: an interrupted --overwrite's, if any, is undone first.
    if args.resume and (saved := overwrite_lib.run_config_path(run_dir)).is_file():
        if args.init_from_hf:
            raise ConfigError(f"--init-from-hf starts a new run, but --resume continues {run_dir} from its own "
                              "checkpoint; drop one of them.")
        # A resumed run keeps its saved config; flags and overrides apply on top (checked in prepare_run_dir).
        base = ckpt.load_run_config(saved.parent)
        config = config_lib.apply_overrides(base, _with_flags(overrides, args))
        if args.preset is not None and args.run_dir:
            _check_preset_matches(args.preset, config, overrides, args, run_dir)
    elif args.init_from_hf:
        hf_config, params, state = load_hf(Path(args.init_from_hf))
        merged = {k: v for k, v in config_lib.load_preset(preset).to_flat_dict().items()
                  if k.split(".")[0] in ("train", "data", "parallel")}
        hf_tokenizer = Path(args.init_from_hf) / "tokenizer.json"
        if args.tokenizer is None and hf_tokenizer.is_file():
            merged["data.tokenizer"] = str(hf_tokenizer)  # the checkpoint's own tokenizer, unless told otherwise
        config = config_lib.apply_overrides(hf_config, {**merged, **_with_flags(overrides, args)})
        init_weights = (params, state)
    else:
        config = build_config(preset, overrides, steps=args.steps, data=args.data, tokenizer=args.tokenizer)
    summary = train(config, run_dir, resume=args.resume, overwrite=args.overwrite, init_weights=init_weights,
                    progress=not args.no_progress)
    if summary.eval_losses and not getattr(summary, "stopped_by", None):
        first, last = summary.eval_losses[0][1], summary.eval_losses[-1][1]
        print(f"dropless: done in {summary.wall_seconds:.0f} s; held-out loss {first:.3f} -> {last:.3f} "
              f"({last / first:.0%} of the first); tokens dropped: {summary.tokens_dropped}; "
              f"run directory {summary.run_dir}")
    return int(getattr(summary, "exit_status", 0))  # 128 + the signal's number for a run a signal stopped


def _check_preset_matches(preset: str, config: config_lib.Config, overrides: dict, args, run_dir: Path) -> None:
    """A resumed run keeps its saved config, so --preset may only name what the run already is."""
    wanted_config = build_config(preset, overrides, steps=args.steps, data=args.data, tokenizer=args.tokenizer)
    if differing := resume_changes(config, wanted_config):
        key = differing[0]
        saved, wanted = config.to_flat_dict(), wanted_config.to_flat_dict()
        raise ConfigError(f"--resume keeps {run_dir}'s saved config, which differs from --preset {preset} at {key} "
                          f"({saved[key]!r} saved, {wanted[key]!r} in the preset); drop --preset to continue the run, "
                          "or start a new one with another --run-dir.")


def _with_flags(overrides: dict, args) -> dict:
    return config_lib.with_flags(overrides, steps=args.steps, data=args.data, tokenizer=args.tokenizer)


def _load_for_inference(args, dtypes=None):
    """(config, params, state) from --run-dir (at --step) or --hf-dir; from --hf-dir, `dtypes` as `load_hf` takes
    it."""
    if args.hf_dir:
        return load_hf(Path(args.hf_dir), dtypes=dtypes)
    overwrite_lib.check_readable(Path(args.run_dir))
    return ckpt.load_model(Path(args.run_dir), step=args.step)


def _check_step(args) -> None:
    if args.step is not None and args.hf_dir:
        raise ConfigError("--step picks a checkpoint of a --run-dir; a Hugging Face directory holds one set of "
                          "weights, so drop --step.")
    if args.step is not None and args.step < 0:
        raise ConfigError(f"--step must be a checkpoint's step (>= 0); got {args.step}.")


def encode_prompt(tokenizer, prompt: str, trained: bool) -> list[int]:
    """The prompt's ids as the model saw text: for a run dropless trained, as training encoded its documents
    (`TextTokenizer.encode`: text spelling a special token stays text, no BOS added); for a Hugging Face checkpoint
    (an --hf-dir, or a run imported from one and not trained since), the tokenizer's own rules, BOS included,
    as `transformers` encodes."""
    if trained:
        tokenizer.encode_special_tokens = True
        return tokenizer.encode(prompt, add_special_tokens=False).ids
    return tokenizer.encode(prompt).ids


def cmd_generate(args) -> int:
    # The cheap checks come first (the flags, the config, the tokenizer), the slow model load last.
    check_sampling(args.temperature, args.top_p, args.max_new_tokens, args.seed, flags=True)
    _check_step(args)
    source = Path(args.hf_dir or args.run_dir)
    saved = ckpt.load_run_config(source) if args.run_dir else convert.config_from_hf(read_hf_config(source))
    check_speculative(saved, args.speculative)
    vocab = saved.model.vocab_size
    tokenizer_path = source / "tokenizer.json"
    if not tokenizer_path.exists():
        raise ConfigError(f"{tokenizer_path} is missing: generation needs the tokenizer the model was trained with "
                          "(a run trained on token ids has none: score ids with 'dropless logits --tokens', or put "
                          "the tokenizer that made them there).")
    tokenizer = read_tokenizer_file(tokenizer_path)
    prompt_ids = encode_prompt(tokenizer, args.prompt, trained=bool(args.run_dir) and not ckpt.imported(source))
    check_prompt(prompt_ids)  # before the model loads
    if max(prompt_ids) >= vocab:
        raise ConfigError(f"{tokenizer_path} gives the prompt token id {max(prompt_ids)}, but the model's vocabulary "
                          f"has {vocab} entries: it is not the tokenizer the model was trained with; put that one "
                          "there.")
    context = saved.model.max_seq_len
    if len(prompt_ids) > context:
        seen = len(prompt_ids) - context_start(len(prompt_ids), context)
        print(f"dropless: the prompt is {len(prompt_ids)} tokens and the model sees the last {seen} of them (its "
              f"context, model.max_seq_len={context}, moves on in steps of half of it).", file=sys.stderr)
    # In the compute dtype before generate() sees them: built so from --hf-dir (no float32 copy on the host or the
    # device), cast from a checkpoint's float32 with each matrix freed once copied (room for one copy only).
    config, params, state = _load_for_inference(
        args, dtypes=lambda config: transformer.inference_dtypes(generation_config(config)))
    params = transformer.inference_weights(params, generation_config(config), donate=True)
    # The end-of-document token training separated documents with, so that a run trained with a given tokenizer
    # ending documents in </s> or <|im_end|> stops there too.
    eos = eos_token(tokenizer)
    stop_id = None if eos is None else tokenizer.token_to_id(eos)
    stats: dict = {}
    ids = generate(config, params, state, prompt_ids, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop_id=stop_id,
                   speculative=args.speculative, stats=stats)
    # The new ids decode after the prompt's: decoded alone, a SentencePiece-style tokenizer (Mixtral's) drops the
    # space that opens the first of them ("▁world" after "Hello" would print "Helloworld").
    prompt_text, text = tokenizer.decode(list(prompt_ids)), tokenizer.decode(list(prompt_ids) + ids)
    print(args.prompt + (text[len(prompt_text):] if text.startswith(prompt_text) else tokenizer.decode(ids)))
    if args.speculative:
        rate = stats["accepted"] / stats["drafted"] if stats["drafted"] else 0.0
        print(f"dropless: {len(ids)} tokens in {stats['forwards']} forward passes; MTP drafts accepted: "
              f"{stats['accepted']} of {stats['drafted']} ({rate:.0%})", file=sys.stderr)
    return 0


def cmd_logits(args) -> int:
    _check_step(args)
    tokens_path = Path(args.tokens)
    if not tokens_path.exists():
        raise ConfigError(f"--tokens {tokens_path} does not exist; give an .npy file of int token ids [batch, seq].")
    tokens = np.asarray(load_token_array(tokens_path, "--tokens "))
    if tokens.ndim != 2:
        raise DataError(f"--tokens must hold an integer array [batch, seq]; {tokens_path} has "
                        f"{tokens.dtype} of shape {tokens.shape}.")
    if tokens.size == 0:
        raise DataError(f"--tokens {tokens_path} holds no tokens (shape {tokens.shape}); give at least one row "
                        "of at least one token id.")
    out = Path(args.out)
    out = out if out.suffix == ".npy" else out.with_name(out.name + ".npy")  # where numpy.save writes
    check_output("--out", args.out, kind=".npy")  # a directory at the path, or a file where its folder goes
    if out.is_dir():
        raise ConfigError(f"--out {args.out} is a directory; give the path of the .npy file to write.")
    if Path(args.out).exists() and not Path(args.out).is_file():  # /dev/null, a pipe: numpy.save would add .npy
        raise ConfigError(f"--out {args.out} is not a regular file; give the path of the .npy file to write.")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {args.out}: the directory {out.parent} does not exist; create it or choose "
                          "another path.")
    if out.resolve() == tokens_path.resolve():
        raise ConfigError(f"--out {args.out} is the --tokens file; writing the logits there would replace the input, "
                          "so choose another path.")
    config, params, state = _load_for_inference(args)
    logits = compute_logits(config, params, state, check_tokens(tokens, config, "--tokens"))
    with atomic_file(out) as file:  # a full disk leaves the previous file whole
        np.save(file, np.asarray(logits, np.float32))
    print(f"dropless: wrote float32 logits of shape {tuple(logits.shape)} to {out}")
    return 0


# What `eval` may set: how the model runs and on what data, never what it is (its weights fix that).
EVAL_GROUPS = ("train.", "data.", "parallel.")
EVAL_KEYS = ("moe.gmm_backend", "moe.dispatch", "moe.dispatch_dtype", "model.attention_backend")


def cmd_eval(args) -> int:
    source, config = _eval_config(args)
    setup = setup_lib.build(config)  # the mesh's checks before the data is read and tokenized
    stream, what = _eval_stream(args, config)
    # Each array straight into its place on the mesh: a model no one device holds is never put on one.
    shardings = {"params": setup.state_shardings.params, "state": setup.state_shardings.model_state}
    if args.run_dir:
        step, _, params, state = ckpt.load_checkpoint(source, args.step, shardings)
    else:  # built in the dtypes a pass reads (bf16 matrices in bf16): the same numbers, half the memory
        step, (_, params, state) = None, load_hf(source, dtypes=lambda _: transformer.inference_dtypes(config),
                                                 shardings=shardings)
    result = evaluate(config, params, state, stream, max_sequences=args.max_sequences, setup=setup, log=_stderr)
    at = f" at step {step}" if step is not None else ""
    print(f"dropless: loss {result.loss:.4f}, perplexity {result.perplexity:.2f}, over {result.tokens:,} tokens "
          f"({result.sequences:,} sequences of {result.seq_len:,}) of {what}, the model of {source}{at}; tokens "
          f"dropped: {result.tokens_dropped}")
    if args.json:  # a diverged model's loss and perplexity as null
        record = {**dataclasses.asdict(result), "perplexity": result.perplexity, "data": what, "model": str(source),
                  "step": step}
        write_atomic(Path(args.json), json.dumps({key: jsonable(value) for key, value in record.items()},
                                                 indent=1) + "\n")
    return 0


def _eval_config(args) -> tuple[Path, config_lib.Config]:
    """(the model's directory, the config eval runs): the saved model's, with --data, the model's tokenizer and the
    overrides on top; every check that needs no data or weights done."""
    overrides = parse_overrides(args.overrides)
    for key in overrides:  # an unknown key is left to apply_overrides, which names the closest one
        if key in config_lib.all_keys() and not (key.startswith(EVAL_GROUPS) or key in EVAL_KEYS):
            raise ConfigError(f"eval scores the model as it was saved, and {key} is part of the model; set only "
                              f"train.*, data.*, parallel.* or {', '.join(EVAL_KEYS)}.")
    if args.max_sequences is not None and args.max_sequences < 1:
        raise ConfigError(f"--max-sequences must be at least 1; got {args.max_sequences}.")
    given = config_lib.with_flags(overrides, data=args.data, tokenizer=args.tokenizer)  # refuses a contradiction
    _check_step(args)
    if args.json:
        check_output("--json", args.json, inputs={"--data": args.data, "--tokenizer": args.tokenizer})
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # before the scoring, not after it
    source = Path(args.hf_dir or args.run_dir)
    if args.run_dir:
        overwrite_lib.check_readable(source)
        saved = ckpt.load_run_config(source)
        ckpt.check_step(source, args.step)
    else:
        saved = convert.config_from_hf(read_hf_config(source))
    if args.data is None and not (args.run_dir and not ckpt.imported(source)):
        raise ConfigError(f"{source} holds a Hugging Face model, which has no data of its own to score; give the "
                          "text or tokens to score with --data PATH.")
    tokenizer = Path(given.get("data.tokenizer") or source / "tokenizer.json")
    if "data.tokenizer" not in given and tokenizer.is_file():  # a run trained on token files has none, needs none
        given["data.tokenizer"] = str(tokenizer)
    config = config_lib.apply_overrides(saved, given)
    data = config.data
    held_out = data.eval_source or data.source  # what the scoring reads, without --data
    if args.data is None and not data.tokenizer and resolve_corpus(held_out, data.max_bytes).kind == "text":
        raise DataError(f"{tokenizer} is missing, and the run's weights were trained with it; put it back "
                        "(from a copy of the run) or give it with --tokenizer.")
    # The id that ends the documents scored, checked against the tokenizer that encodes them.
    return source, config.replace(**{"data.eos_id": resolve_eos_id(data, config.model.vocab_size)})


def _eval_stream(args, config: config_lib.Config):
    """(the tokens to score, what they are): --data whole, or the run's held-out data as its config gives it."""
    if args.data is not None:
        stream, corpus = load_token_stream(config.data, config.model.vocab_size, log=_stderr)
        return stream, corpus.name
    # The run's own data: its token cache is read where it holds that data for its tokenizer, never written.
    if config.data.eval_source:  # scored whole: data.source is neither needed nor read
        stream, corpus = load_token_stream(config.data, config.model.vocab_size, log=_stderr, setting="eval_source",
                                           read_cache=args.run_dir)
        return stream, f"the run's validation corpus, {corpus.name}"
    dataset, _ = load_token_dataset(config.data, config.model.vocab_size, config.train.seq_len, log=_stderr,
                                    read_cache=args.run_dir)
    return dataset.eval_stream, f"the held-out split of {dataset.description}"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def cmd_convert(args) -> int:
    if (args.from_hf or args.to) and (args.from_run or args.to_hf):
        raise ConfigError("convert does one direction at a time: give --from-hf HF_DIR --to RUN_DIR or "
                          "--from RUN_DIR --to-hf HF_DIR, not both; run it twice for both.")
    if args.from_hf and args.to:
        convert.convert_from_hf(Path(args.from_hf), Path(args.to))
        print(f"dropless: imported {args.from_hf} into run directory {args.to}")
    elif args.from_run and args.to_hf:
        overwrite_lib.check_readable(Path(args.from_run))
        step = convert.convert_to_hf(Path(args.from_run), Path(args.to_hf))
        print(f"dropless: exported checkpoint {step} of {args.from_run} to Hugging Face format in {args.to_hf}")
    else:
        raise ConfigError("convert needs either --from-hf HF_DIR --to RUN_DIR or --from RUN_DIR --to-hf HF_DIR.")
    return 0


def cmd_presets(args) -> int:
    if args.keys:
        for key in config_lib.all_keys():
            print(key)
        return 0
    for name in config_lib.preset_names():
        print(f"{name:20s} {config_lib.preset_description(name)}")
    return 0


def _out_of_memory_message(err: MemoryError, args) -> str:
    """The one line for host memory running out, with numpy's size of the failed allocation where it gives one."""
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    what = f"out of host memory ({detail[0].lower() + detail[1:].rstrip('.')})" if detail else "out of host memory"
    if getattr(args, "command", None) == "train":
        return (f"{what}; lower train.batch_size, train.seq_len or train.eval_batches (the held-out set alone holds "
                "eval_batches x batch_size sequences).")
    return f"{what}; ask for less (a smaller model, batch or input) or free some memory."


def _device_memory_message(err: BaseException, args) -> str | None:
    """The one line for the accelerator (or XLA's CPU heap) running out of memory, with XLA's own words on the failed
    allocation; None for any other runtime error, which keeps its traceback."""
    text = str(err).strip()
    if not text.startswith("RESOURCE_EXHAUSTED"):
        return None
    detail = text.splitlines()[0].removeprefix("RESOURCE_EXHAUSTED:").strip().rstrip(".")
    what = f"out of device memory ({detail[0].lower() + detail[1:]})" if detail else "out of device memory"
    command = getattr(args, "command", None)
    if command == "train":
        return (f"{what}; lower train.batch_size or train.seq_len, raise train.grad_accum_steps, or set "
                "train.remat=full ('dropless plan --search' with the same --preset and overrides lists layouts that "
                "fit); the run's saved checkpoints are unchanged.")
    if command == "logits":
        return (f"{what}; give fewer or shorter rows in --tokens (the logits alone take rows x length x vocab x 4 "
                "bytes).")
    return f"{what}; ask for less (a smaller model, batch or input) or free the device."


def _interrupted_message(args) -> str:
    """The line after Ctrl-C, true whether or not the run has a checkpoint. The training loop turns SIGINT into a
    checkpoint and a clean stop itself, so a KeyboardInterrupt mostly comes from before it (loading, tokenizing,
    compiling), often before any checkpoint exists."""
    if getattr(args, "command", None) != "train":
        return "dropless: interrupted."
    if not (args.run_dir or args.resume):  # a new runs/<preset>-<time>, which no checkpoint reached
        return "dropless: interrupted before the run's first checkpoint; run the same command again to start over."
    try:
        run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(args.preset or DEFAULT_PRESET, True)
        has_checkpoint = ckpt.latest_step(run_dir) is not None
    except Exception:  # noqa: BLE001 - whatever stops the look (no run yet, a damaged one), the advice below holds
        return "dropless: interrupted; run the same command again (with --resume if a checkpoint was written)."
    if has_checkpoint:
        return f"dropless: interrupted; {run_dir}'s last finished checkpoint is intact (continue it with --resume)."
    again = "run the same command again without --resume" if args.resume else "run the same command again"
    return f"dropless: interrupted before {run_dir} had a checkpoint; {again} to start it from step 0."


def _delegate(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv) or 0)


def make_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dropless", description="Dropless Mixture-of-Experts training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    train = sub.add_parser("train", help="train a model (default: the tiny preset on the Python stdlib corpus)")
    train.add_argument("--preset", help=f"a preset name (see 'dropless presets'; default {DEFAULT_PRESET}); "
                       "with --resume, it picks the latest runs/<preset>-<date>-<time> and must match the run")
    train.add_argument("--steps", type=int, help="total optimizer steps of the run (with --resume: train until N)")
    train.add_argument("--run-dir", type=path_text,
                       help="where config, checkpoints and metrics go (default: runs/<preset>-<date>-<time>)")
    train.add_argument("--data", type=path_text,
                       help="file, directory or glob of .txt/.jsonl/.parquet/.npy/.bin (default: stdlib)")
    train.add_argument("--tokenizer", type=path_text,
                       help="a tokenizer.json to use instead of training a BPE on the corpus")
    train.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    train.add_argument("--overwrite", action="store_true", help="replace whatever run --run-dir holds")
    train.add_argument("--init-from-hf", type=path_text,
                       help="start from a Hugging Face checkpoint directory (fine-tuning)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar: a line per logged step instead")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, anywhere among the options, e.g. moe.gmm_backend=xla")
    train.set_defaults(func=cmd_train)

    for name, func, help_text in (("generate", cmd_generate, "sample text from a trained model"),
                                  ("logits", cmd_logits, "float32 logits for token ids, to verify a model")):
        p = sub.add_parser(name, help=help_text)
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--run-dir", type=path_text, help="a dropless run directory (latest checkpoint)")
        source.add_argument("--hf-dir", type=path_text, help="a Hugging Face checkpoint directory")
        p.add_argument("--step", type=int, help="the run's checkpoint of this step (default: its latest good one)")
        p.set_defaults(func=func)
        if name == "generate":
            p.add_argument("--prompt", required=True, type=lambda text: utf8_text(text, "prompt"),
                           help="the text to continue")
            p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
            p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
            p.add_argument("--top-p", type=float, default=0.95,
                           help="sample from the smallest set of tokens holding this probability (default 0.95)")
            p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
            p.add_argument("--speculative", action="store_true",
                           help="draft each next token with the model's MTP module and verify it in the same pass "
                                "(same output distribution; greedy output unchanged)")
        else:
            p.add_argument("--tokens", required=True, type=path_text, help=".npy int array [batch, seq]")
            p.add_argument("--out", required=True, type=path_text,
                           help="where to write the .npy float32 [batch, seq, vocab]")

    evaluation = sub.add_parser("eval", help="a model's loss and perplexity on data, every token scored once")
    source = evaluation.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", type=path_text, help="a dropless run directory (latest good checkpoint)")
    source.add_argument("--hf-dir", type=path_text, help="a Hugging Face checkpoint directory")
    evaluation.add_argument("--data", type=path_text,
                            help="file, directory or glob of .txt/.jsonl/.parquet/.npy/.bin to score, whole "
                                 "(default: the run's held-out data: its split of data.source, or data.eval_source)")
    evaluation.add_argument("--tokenizer", type=path_text,
                            help="the tokenizer.json to encode text with (default: the model's own)")
    evaluation.add_argument("--step", type=int, help="the run's checkpoint of this step (default: its latest good one)")
    evaluation.add_argument("--max-sequences", type=int, help="score only the first N sequences")
    evaluation.add_argument("--json", type=path_text, help="also write the figures to this JSON file")
    evaluation.add_argument("overrides", nargs="*", metavar="key=value",
                            help="e.g. train.batch_size=16 train.seq_len=2048 parallel.fsdp=8")
    evaluation.set_defaults(func=cmd_eval)

    convert = sub.add_parser("convert", help="import from / export to Hugging Face format")
    convert.add_argument("--from-hf", type=path_text, help="Hugging Face directory to import")
    convert.add_argument("--to", type=path_text, help="run directory to create")
    convert.add_argument("--from", dest="from_run", type=path_text, help="run directory to export")
    convert.add_argument("--to-hf", type=path_text, help="Hugging Face directory to write")
    convert.set_defaults(func=cmd_convert)

    presets = sub.add_parser("presets", help="list the model presets")
    presets.add_argument("--keys", action="store_true", help="list every config key instead")
    presets.set_defaults(func=cmd_presets)

    # These hand their arguments, untouched, to their own parsers (see PASS_THROUGH in main).
    bench = sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)} (see 'dropless bench NAME --help')",
                           usage="dropless bench NAME [options]", formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="benchmarks (each prints and saves its figures; 'dropless bench NAME --help' "
                                       "for its options):\n" + "\n".join(f"  {name:14s} {what}"
                                                                       for name, (_, what) in BENCHMARKS.items()))
    bench.add_argument("name", choices=tuple(BENCHMARKS), help="the benchmark")
    sub.add_parser("plan", help="will a training step fit, how fast will it run (see 'dropless plan --help')")
    sub.add_parser("tune-gmm", help="autotune the grouped GEMM on this GPU (see 'dropless tune-gmm --help')")
    sub.add_parser("profile", help="trace training steps and break down device time (see 'dropless profile --help')")
    return parser


PASS_THROUGH = {"tune-gmm": "dropless.bench.tune_gmm", "profile": "dropless.bench.profile",
                "plan": "dropless.bench.plan"}


def _pass_through(argv: list[str]):
    """(module, its argv) when argv names a command whose arguments its own parser reads, else None."""
    if not argv:
        return None
    if argv[0] in PASS_THROUGH:
        return PASS_THROUGH[argv[0]], argv[1:]
    if argv[0] == "bench":
        if len(argv) >= 2 and argv[1] == "memory":
            raise ConfigError("there is no 'dropless bench memory': 'dropless plan' reports the memory (the same "
                              "arguments, no compiling; --compiled adds XLA's figures); see 'dropless plan --help'.")
        if len(argv) >= 2 and argv[1] in ("-h", "--help"):
            return None  # the bench parser's help: the benchmarks with what each measures
        if len(argv) < 2 or argv[1] not in BENCHMARKS:
            raise ConfigError(f"dropless bench needs one of {', '.join(sorted(BENCHMARKS))}, "
                              "e.g. 'dropless bench gmm --help'.")
        return BENCHMARKS[argv[1]][0], argv[2:]
    return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse a command line; `key=value` overrides may stand anywhere among `train`'s and `eval`'s options."""
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in ("train", "eval"):
        args.overrides += [a for a in extra if not a.startswith("-")]
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        command = parser._subparsers._group_actions[0].choices[args.command]
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def is_user_error(err: BaseException) -> bool:
    """dropless's own ValueError subclasses (ConfigError, DataError, CheckpointError, ...) carry one sentence
    for the user; so do OS errors the user's files or machine cause (a missing or unreadable file, a full
    disk). Any other exception is a bug and keeps its traceback."""
    if isinstance(err, OSError):
        return err.errno in OS_ERROR_FIXES
    return isinstance(err, ValueError) and type(err).__module__.startswith("dropless")


def user_message(err: BaseException) -> str:
    """The one line printed for a user error."""
    if isinstance(err, OSError) and err.errno in OS_ERROR_FIXES:
        where = f"{err.filename}: " if err.filename is not None else ""
        reason = (err.strerror or os.strerror(err.errno)).rstrip(".")
        return f"{where}{reason[0].lower() + reason[1:]}; {OS_ERROR_FIXES[err.errno]}."
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _debug_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """(--debug or DROPLESS_DEBUG=1 given, argv without --debug); the flag may stand anywhere."""
    return debugging() or DEBUG_FLAG in argv, [a for a in argv if a != DEBUG_FLAG]


@contextlib.contextmanager
def _debug_environment(debug: bool):
    """DROPLESS_DEBUG=1 while the command runs when --debug is given: library code that holds back details for a
    one-line error (dropless.train.checkpoint) then shows them."""
    previous = os.environ.get(DEBUG_ENV)
    if debug:
        os.environ[DEBUG_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = previous


def _one_line_warnings() -> None:
    """Show our own warnings (e.g. a skipped undecodable file) as one plain line each."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__module__.startswith("dropless"):
            print(f"dropless: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def _quiet_abandoned_writes() -> None:
    """After a user error the process exits with writes the failed step had started still pending (orbax's
    asynchronous tensor writes, e.g. on a full disk), and the interpreter's shutdown warns of each coroutine it
    never ran, after the one line that already said what failed (an interrupted checkpoint is never made
    visible). Those warnings stay out of that output; DROPLESS_DEBUG keeps them."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


def _quiet_library_logs() -> None:
    """orbax logs routine notes (e.g. on read-only checkpoint access) as absl warnings: keep errors only (the
    checkpoint module leaves out the metadata notes its own one line replaces)."""
    logging.getLogger("absl").setLevel(logging.ERROR)


def fewer_collections() -> None:
    """Tracing and lowering a step allocate objects by the million beside a large heap (JAX, orbax, their caches),
    which each full collection walks: the cyclic collector runs every 50,000 allocations instead of Python's 700,
    and walks the whole heap hardly ever instead of every 100 runs. Cycles that die young are still freed."""
    gc.set_threshold(50_000, 50, 1_000)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug, argv = _debug_requested(argv)
    _one_line_warnings()
    _quiet_library_logs()
    fewer_collections()
    args = None
    try:
        with _debug_environment(debug):
            delegated = _pass_through(argv)
            if delegated is not None:
                status = _delegate(*delegated)
            else:
                args = parse_args(argv)
                # Several processes (hosts) join one JAX runtime before anything else touches JAX; a no-op alone.
                distributed.initialize()
                status = args.func(args)
            sys.stdout.flush()  # a reader that has gone (`| head`) shows here, not in the interpreter's last flush
            return status
    except BrokenPipeError:
        # The reader of our output closed it (`dropless presets | head -1`): stop quietly, with the status of a
        # command SIGPIPE ended, as other tools do. stdout then points at devnull, so that the interpreter's
        # flush at exit does not fail a second time (the recipe of Python's `signal` documentation).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except MemoryError as err:
        if debug:
            traceback.print_exc()
        print(f"dropless: error: {_out_of_memory_message(err, args)}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as err:
        message = _device_memory_message(err, args)
        if message is None:
            raise  # not the user's request outgrowing the device: keep the traceback
        if debug:
            traceback.print_exc()
        print(f"dropless: error: {message}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:
        if not is_user_error(err):
            raise  # our own bug: keep the traceback
        if debug:
            traceback.print_exc()
        print(f"dropless: error: {user_message(err)}", file=sys.stderr)
        if not debug:
            _quiet_abandoned_writes()
        # An error may carry its own documented status (e.g. a stopped run); 2 for every other user error.
        return int(getattr(err, "exit_status", 2))
    except KeyboardInterrupt:
        print(_interrupted_message(args), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
