"""The `dropless` command line: parse, build, call the library. Everything it does is importable.

User mistakes (bad flags, config keys, data, checkpoints) end the process with one line on stderr
and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import sys
import warnings
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from dropless import convert
from dropless.convert import compute_logits, load_hf
from dropless.core import config as config_lib
from dropless.core import distributed
from dropless.core.config import ConfigError, build_config, parse_overrides
from dropless.models.generate import generate
from dropless.train import checkpoint as ckpt
from dropless.train.loop import train

OS_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
BENCHMARKS = {"gmm": "dropless.bench.gmm", "ep": "dropless.bench.ep", "step": "dropless.bench.step",
              "memory": "dropless.bench.memory", "scale": "dropless.bench.scale"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        self.exit(2, f"dropless: error: {message} (see 'dropless {self.prog.split()[-1]} --help').\n")


def _default_run_dir(preset: str, resume: bool) -> Path:
    runs = Path("runs")
    if resume:
        existing = sorted(runs.glob(f"{preset}-*")) if runs.is_dir() else []
        if not existing:
            raise ConfigError(f"--resume found no earlier '{preset}' run under runs/; pass --run-dir DIR.")
        return existing[-1]
    return runs / f"{preset}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def cmd_train(args) -> int:
    overrides = parse_overrides(args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(args.preset, args.resume)
    init_weights = None
    if args.resume and (run_dir / "config.json").is_file():
        # A resumed run keeps its saved config; flags and overrides apply on top (checked in prepare_run_dir).
        base = ckpt.load_run_config(run_dir)
        config = config_lib.apply_overrides(base, {**overrides, **_flag_overrides(args)})
    elif args.init_from_hf:
        hf_config, params, state = load_hf(Path(args.init_from_hf))
        merged = {k: v for k, v in _flat_dict(config_lib.load_preset(args.preset)).items()
                  if k.split(".")[0] in ("train", "data", "parallel")}
        hf_tokenizer = Path(args.init_from_hf) / "tokenizer.json"
        if args.tokenizer is None and hf_tokenizer.is_file():
            merged["data.tokenizer"] = str(hf_tokenizer)  # the checkpoint's own tokenizer, unless told otherwise
        config = config_lib.apply_overrides(hf_config, {**merged, **overrides, **_flag_overrides(args)})
        init_weights = (params, state)
    else:
        config = build_config(args.preset, overrides, steps=args.steps, data=args.data, tokenizer=args.tokenizer)
    summary = train(config, run_dir, resume=args.resume, overwrite=args.overwrite, init_weights=init_weights,
                    progress=not args.no_progress)
    if summary.eval_losses:
        first, last = summary.eval_losses[0][1], summary.eval_losses[-1][1]
        print(f"dropless: done in {summary.wall_seconds:.0f} s; held-out loss {first:.3f} -> {last:.3f} "
              f"({last / first:.0%} of the first); tokens dropped: {summary.tokens_dropped}; "
              f"run directory {summary.run_dir}")
    return 0


def _flag_overrides(args) -> dict:
    flags = {}
    if args.steps is not None:
        flags["train.steps"] = args.steps
    if args.data is not None:
        flags["data.source"] = args.data
    if args.tokenizer is not None:
        flags["data.tokenizer"] = args.tokenizer
    return flags


def _flat_dict(config: config_lib.Config) -> dict:
    return {f"{g}.{k}": v for g, d in config.to_dict().items() for k, v in d.items()}


def _load_for_inference(args):
    """(config, params, state, tokenizer path) from --run-dir or --hf-dir."""
    if args.hf_dir:
        config, params, state = load_hf(Path(args.hf_dir))
        tokenizer_path = Path(args.hf_dir) / "tokenizer.json"
    else:
        config, params, state = ckpt.load_model(Path(args.run_dir))
        tokenizer_path = Path(args.run_dir) / "tokenizer.json"
    return config, params, state, tokenizer_path


def cmd_generate(args) -> int:
    config, params, state, tokenizer_path = _load_for_inference(args)
    if not tokenizer_path.is_file():
        raise ConfigError(f"{tokenizer_path} is missing; generation needs the tokenizer the model was trained with.")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    stop_id = tokenizer.token_to_id("<|endoftext|>")
    ids = generate(config, params, state, tokenizer.encode(args.prompt).ids, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, seed=args.seed, stop_id=stop_id)
    print(args.prompt + tokenizer.decode(ids))
    return 0


def cmd_logits(args) -> int:
    tokens_path = Path(args.tokens)
    if not tokens_path.is_file():
        raise ConfigError(f"--tokens {tokens_path} does not exist; give an .npy file of int token ids [batch, seq].")
    tokens = np.load(tokens_path)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"--tokens must hold an integer array [batch, seq]; {tokens_path} has "
                          f"{tokens.dtype} of shape {tokens.shape}.")
    config, params, state, _ = _load_for_inference(args)
    if tokens.min() < 0 or tokens.max() >= config.model.vocab_size:
        raise ConfigError(f"--tokens holds ids outside [0, {config.model.vocab_size}); the model's vocabulary "
                          f"has {config.model.vocab_size} entries.")
    logits = compute_logits(config, params, state, tokens.astype(np.int32))
    np.save(args.out, np.asarray(logits, np.float32))
    print(f"dropless: wrote float32 logits of shape {tuple(logits.shape)} to {args.out}")
    return 0


def cmd_convert(args) -> int:
    if args.from_hf and args.to:
        convert.convert_from_hf(Path(args.from_hf), Path(args.to))
        print(f"dropless: imported {args.from_hf} into run directory {args.to}")
    elif args.from_run and args.to_hf:
        convert.convert_to_hf(Path(args.from_run), Path(args.to_hf))
        print(f"dropless: exported {args.from_run} to Hugging Face format in {args.to_hf}")
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


def _delegate(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv) or 0)


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dropless", description="Dropless Mixture-of-Experts training in JAX.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    train = sub.add_parser("train", help="train a model (default: the tiny preset on the Python stdlib corpus)")
    train.add_argument("--preset", default="tiny", help="a preset name (see 'dropless presets')")
    train.add_argument("--steps", type=int, help="total optimizer steps of the run (with --resume: train until N)")
    train.add_argument("--run-dir", help="where config, checkpoints and metrics go (default: runs/<preset>-<time>)")
    train.add_argument("--data", help="file, directory or glob of .txt/.jsonl/.parquet/.npy/.bin (default: stdlib)")
    train.add_argument("--tokenizer", help="a tokenizer.json to use instead of training a BPE on the corpus")
    train.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    train.add_argument("--overwrite", action="store_true", help="replace whatever run --run-dir holds")
    train.add_argument("--init-from-hf", help="start from a Hugging Face checkpoint directory (fine-tuning)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. moe.gmm_backend=xla")
    train.set_defaults(func=cmd_train)

    for name, func, help_text in (("generate", cmd_generate, "sample text from a trained model"),
                                  ("logits", cmd_logits, "float32 logits for token ids, to verify a model")):
        p = sub.add_parser(name, help=help_text)
        source = p.add_mutually_exclusive_group(required=True)
        source.add_argument("--run-dir", help="a dropless run directory (latest checkpoint)")
        source.add_argument("--hf-dir", help="a Hugging Face checkpoint directory")
        p.set_defaults(func=func)
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("--max-new-tokens", type=int, default=64)
            p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
            p.add_argument("--top-p", type=float, default=0.95)
            p.add_argument("--seed", type=int, default=0)
        else:
            p.add_argument("--tokens", required=True, help=".npy int array [batch, seq]")
            p.add_argument("--out", required=True, help="where to write the .npy float32 [batch, seq, vocab]")

    convert = sub.add_parser("convert", help="import from / export to Hugging Face format")
    convert.add_argument("--from-hf", help="Hugging Face directory to import")
    convert.add_argument("--to", help="run directory to create")
    convert.add_argument("--from", dest="from_run", help="run directory to export")
    convert.add_argument("--to-hf", help="Hugging Face directory to write")
    convert.set_defaults(func=cmd_convert)

    presets = sub.add_parser("presets", help="list the model presets")
    presets.add_argument("--keys", action="store_true", help="list every config key instead")
    presets.set_defaults(func=cmd_presets)

    # These hand their arguments, untouched, to their own parsers (see PASS_THROUGH in main).
    sub.add_parser("bench", help=f"benchmarks: {', '.join(BENCHMARKS)} (see 'dropless bench NAME --help')")
    sub.add_parser("tune-gmm", help="autotune the grouped GEMM on this GPU (see 'dropless tune-gmm --help')")
    sub.add_parser("profile", help="trace training steps and break down device time (see 'dropless profile --help')")
    return parser


PASS_THROUGH = {"tune-gmm": "dropless.bench.tune_gmm", "profile": "dropless.bench.profile"}


def _pass_through(argv: list[str]):
    """(module, its argv) when argv names a command whose arguments its own parser reads, else None."""
    if not argv:
        return None
    if argv[0] in PASS_THROUGH:
        return PASS_THROUGH[argv[0]], argv[1:]
    if argv[0] == "bench":
        if len(argv) < 2 or argv[1] not in BENCHMARKS:
            raise ConfigError(f"dropless bench needs one of {', '.join(sorted(BENCHMARKS))}, "
                              "e.g. 'dropless bench gmm --help'.")
        return BENCHMARKS[argv[1]], argv[2:]
    return None


def is_user_error(err: BaseException) -> bool:
    """dropless's own ValueError subclasses (ConfigError, DataError, CheckpointError, ...) carry one sentence
    for the user; so do missing or unreadable files. Any other exception is a bug and keeps its traceback."""
    if isinstance(err, OS_ERRORS):
        return True
    return isinstance(err, ValueError) and type(err).__module__.startswith("dropless")


def _one_line_warnings() -> None:
    """Show our own warnings (e.g. a skipped undecodable file) as one plain line each."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__module__.startswith("dropless"):
            print(f"dropless: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def _quiet_library_logs() -> None:
    """orbax logs routine notes (e.g. on read-only checkpoint access) as absl warnings: keep errors only."""
    logging.getLogger("absl").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _one_line_warnings()
    _quiet_library_logs()
    try:
        delegated = _pass_through(argv)
        if delegated is not None:
            return _delegate(*delegated)
        args = make_parser().parse_args(argv)
        # Several processes (hosts) join one JAX runtime before anything else touches JAX; a no-op alone.
        distributed.initialize()
        return args.func(args)
    except (ValueError, *OS_ERRORS) as err:
        if not is_user_error(err):
            raise  # our own bug: keep the traceback
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"dropless: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dropless: interrupted; the last finished checkpoint is intact (resume with --resume).", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
