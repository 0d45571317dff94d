"""The training loop: run directory, data, mesh, state, jitted step, logging, evaluation, checkpoints.

Exact resumption rests on three facts: the batch at step n is a pure function of (data seed, n); the
checkpoint holds every array the step reads (params, optimizer state, router biases, step counter); and
nothing else in the step is random. So a run resumed at step n computes bit for bit what an
uninterrupted run computes at step n.

What stops a run early:
- A signal of `train.stop_signals` (SIGTERM, SIGINT, SIGUSR1 by default): the current step finishes, a
  checkpoint of it is written (unless that step has one), one line says so, and `RunSummary.exit_status` is
  128 + the signal's number, the shell's convention (143 for SIGTERM). A second signal while stopping is
  ignored, so the checkpoint being written finishes. With several processes the signal may reach only one of
  them: they agree at the next step where the host waits for the device anyway (a logged, evaluated or
  checkpointed step) with a tiny all-gather, and all stop there; alone, a process stops after the very step.
- `train.max_nonfinite_steps` steps in a row whose loss or gradient norm is not finite (none of them applied,
  see `dropless.train.step`): `TrainingDiverged`, naming the step and the last good checkpoint. The flags are
  read where the host waits anyway, so the check costs no extra round trip, and no checkpoint is written
  after the streak reached its limit.
"""

from __future__ import annotations

import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from dropless.core import config as config_lib
from dropless.core import files
from dropless.core.config import Config, ConfigError
from dropless.data import load_token_dataset, resolve_eos_id
from dropless.data.loader import CACHE_DIR, EVAL_TOKEN_CACHE, ORIGIN_FILE, TOKEN_CACHE, TOKENIZER_FILE
from dropless.gmm.registry import resolve_backend_name
from dropless.models import flops as flops_lib
from dropless.models import transformer
from dropless.plan.report import LAYOUT_KEYS
from dropless.train import checkpoint as ckpt
from dropless.train import metrics as metrics_lib
from dropless.train import overwrite as overwrite_lib
from dropless.train import run_lock
from dropless.train import setup as setup_lib
from dropless.train.step import TrainState, make_eval_step

# Keys a resumed run may change: they steer logging, stopping and the run's length, not what a step computes, or
# the mesh it runs on (parallel.*: checkpoints restore into any mesh's shardings; the same step, to rounding).
# `train.schedule_steps` changes the learning rate from the resumed step on, and only when given explicitly: a
# resumed run keeps the saved horizon otherwise, whatever its `train.steps`.
RESUMABLE_CHANGES = {"train.steps", "train.log_every", "train.eval_every", "train.checkpoint_every",
                     "train.keep_checkpoints", "train.eval_batches", "train.plot", "data.prefetch",
                     "train.schedule_steps", "train.stop_signals", "train.max_nonfinite_steps",
                     "train.device_memory_gib", "train.auto_fit", "parallel.data", "parallel.fsdp", "parallel.expert"}

# The exit status for a run stopped by the divergence guard (a finished run: 0; a user error: 2).
EXIT_DIVERGED = 3


class TrainingDiverged(ValueError):
    """The loss or gradient norm was not finite for `train.max_nonfinite_steps` steps in a row; the message
    names the step and the last good checkpoint."""

    exit_status = EXIT_DIVERGED


@dataclass
class RunSummary:
    run_dir: Path
    first_step: int
    last_step: int  # the last step trained (and checkpointed, where a signal stopped the run)
    eval_losses: list[tuple[int, float]]  # the whole run's, from its first evaluation, across resumptions
    wall_seconds: float
    tokens_dropped: int
    stopped_by: str | None = None  # the signal that stopped the run before train.steps (e.g. "SIGTERM")

    @property
    def exit_status(self) -> int:
        """0 for a run that reached train.steps; 128 + the signal's number for one a signal stopped (143 for
        SIGTERM, 130 for SIGINT, 138 for SIGUSR1), as for a process the signal killed."""
        return 128 + signal.Signals[self.stopped_by].value if self.stopped_by else 0


def resume_changes(saved: Config, config: Config) -> list[str]:
    """The keys in which `config` differs from a run's saved config that a resume may not change, sorted."""
    saved_flat, given = saved.to_flat_dict(), config.to_flat_dict()
    return sorted(k for k, v in given.items() if saved_flat[k] != v and k not in RESUMABLE_CHANGES)


# The files a run writes with files.write_atomic (RUN_DIR/..., RUN_DIR/corpus/...), whose temporaries a kill leaves:
# only theirs are deleted, for a directory the user made may hold a NAME.<number>.tmp of their own.
_ATOMIC_WRITES = {".": ("config.json", TOKENIZER_FILE, "router.json"),
                  CACHE_DIR: (ORIGIN_FILE, TOKEN_CACHE, EVAL_TOKEN_CACHE)}


def prepare_run_dir(run_dir: Path, config: Config, *, resume: bool, overwrite: bool,
                    log: Callable[[str], None] = lambda message: None) -> Config:
    """Create or validate the run directory; returns the config the run will use, with its schedule horizon
    (`train.schedule_steps`) resolved: a new run's 0 becomes its `train.steps`, a resumed run's 0 the saved value.

    A directory whose run never reached its first checkpoint (it failed on its data, or was killed early) holds
    nothing worth keeping: the same config starts it again from step 0 without --overwrite; another config is
    refused with the one flag that replaces it. A run replaced so waits in RUN_DIR/.replaced, which the caller
    deletes once the new run has written its first checkpoint (`overwrite.discard`) or puts back where it fails
    before that (`overwrite.put_back`); a start that finds one puts it back first (`overwrite.recover`). A directory
    of other files, without a run's config.json, is not taken for a run."""
    run_dir = Path(run_dir)
    overwrite_lib.recover(run_dir, log)
    for directory, names in _ATOMIC_WRITES.items():  # a kill's leftovers: this process holds the run's lock
        files.remove_temporaries(run_dir / directory, names)
    if not overwrite:  # --overwrite sets aside whatever stands there, as the old run's
        _check_fixed_outputs(run_dir, config)
    saved_path = run_dir / "config.json"
    if ckpt.imported(run_dir) and not overwrite:  # refused before its corpus is read, let alone tokenized
        raise ConfigError(f"{run_dir} holds weights imported from Hugging Face, without the optimizer state a run "
                          f"continues from; {ckpt.imported_fix(run_dir)}, or pass --overwrite to replace it.")
    if resume:
        if not saved_path.is_file():
            raise ckpt.CheckpointError(f"--resume was given but {run_dir} holds no run (no config.json); "
                                       "drop --resume to start a new run there.")
        saved = ckpt.load_run_config(run_dir)
        if config.train.schedule_steps == 0:  # not given: the saved horizon (a run saved before it had one: its steps)
            config = config.replace(**{"train.schedule_steps": saved.train.schedule_horizon})
        if config.data.eos_id == -1:  # not given: the id the run resolved when it started (`resolve_eos_id`)
            config = config.replace(**{"data.eos_id": saved.data.eos_id})
        if changed := resume_changes(saved, config):
            key = changed[0]
            flag = config_lib.FLAGS.get(key)  # a setting `dropless train` also takes as a flag is named beside it
            given = f"that override ({flag} or {key}=)" if flag else "that override"
            raise ConfigError(f"--resume keeps the saved config, but {key} differs from the run's "
                              f"({saved.to_flat_dict()[key]!r} saved, {config.to_flat_dict()[key]!r} given); drop "
                              f"{given} or start a new run with --overwrite or another --run-dir.")
        reached = ckpt.latest_step(run_dir)
        if reached is not None and config.train.steps < reached and (reason := ckpt.unfinished(run_dir, reached)):
            # not a step the run reached (a stray or copied-in directory): training to it would start far behind
            raise ckpt.CheckpointError(f"checkpoint {reached} in {ckpt.checkpoint_dir(run_dir)} is not one the run "
                                       f"saved ({reason}); move it away and resume.")
        if reached is not None and config.train.steps < reached:  # the saved config would shrink behind the run
            raise ConfigError(f"--resume to step {config.train.steps}, but {run_dir} has a checkpoint of step "
                              f"{reached} already; give --steps {reached} or more (the run's is "
                              f"{saved.train.steps}).")
        decay_start = saved.train.decay_start
        if (reached is not None and config.train.decay_steps and reached > decay_start
                and config.train.schedule_horizon != saved.train.schedule_horizon):
            log(f"dropless: warning: checkpoint {reached} is past the start of the run's decay (step {decay_start}); "
                f"train.schedule_steps={config.train.schedule_horizon} puts the learning rate back up to its peak, "
                "without a warm-up, and decays it again")
        if config != saved:  # a resumable setting changed (the steps, say); an unchanged file is left untouched
            config_lib.save(config, saved_path)
        return config
    config = config.replace(**{"train.schedule_steps": config.train.schedule_horizon,
                               "data.eos_id": resolve_eos_id(config.data, config.model.vocab_size)})
    if run_dir.exists() and any(p.name != run_lock.LOCK_NAME for p in run_dir.iterdir()):
        # Without --overwrite a Hugging Face model's directory gets load_run_config's advice (--hf-dir, convert).
        if (foreign := ckpt.foreign_config(run_dir)) and (overwrite or not ckpt.hugging_face_config(saved_path)):
            raise ConfigError(f"{foreign}, and a run would write its own config.json over that file "
                              f"({'--overwrite replaces runs only' if overwrite else 'no run starts there'}); choose "
                              "another --run-dir.")
        saved = None if overwrite or not saved_path.is_file() else ckpt.load_run_config(run_dir)
        if saved is not None and not ckpt.reached_a_checkpoint(run_dir):
            if saved != config:
                raise ConfigError(f"{run_dir} holds a run that never reached its first checkpoint, with another "
                                  f"config ({_difference(saved, config)}); pass --overwrite to replace it, or choose "
                                  "another --run-dir.")
            log(f"dropless: {run_dir} holds this run, which never reached its first checkpoint; starting it again "
                "from step 0")
        elif not overwrite and not saved_path.is_file() and not ckpt.checkpoint_dir(run_dir).exists():
            raise ConfigError(f"{run_dir} is not empty but holds no run (no config.json); choose a new or empty "
                              "--run-dir, or pass --overwrite to start a run there beside its files.")
        elif not overwrite:
            raise ConfigError(_already_holds(run_dir, saved, config))
        overwrite_lib.set_aside(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        config_lib.save(config, saved_path)
    except BaseException:
        overwrite_lib.put_back(run_dir)
        raise
    return config


def _already_holds(run_dir: Path, saved: Config | None, config: Config) -> str:
    """The refusal of a new run in a directory holding a run with a checkpoint: what --resume would do with the
    given settings, naming the first setting that differs from the saved one."""
    if saved is None or saved == config:
        return (f"{run_dir} already holds a run; pass --resume to continue it, --overwrite to replace it, or choose "
                "another --run-dir.")
    fixed = resume_changes(saved, config)
    resume = ("--resume continues it only without that override" if fixed
              else "pass --resume to continue it with the given settings")
    return (f"{run_dir} already holds a run with a different config ({_difference(saved, config, fixed)}); "
            f"{resume}, --overwrite replaces it, or choose another --run-dir.")


def _difference(saved: Config, config: Config, keys: list[str] | None = None) -> str:
    """The first of `keys` (default: the first setting) in which `config` differs from the saved one, as
    `KEY: SAVED saved, GIVEN given`."""
    saved_flat, given = saved.to_flat_dict(), config.to_flat_dict()
    key = keys[0] if keys else next(k for k, v in given.items() if saved_flat[k] != v)
    return f"{key}: {saved_flat[key]!r} saved, {given[key]!r} given"


def _check_fixed_outputs(run_dir: Path, config: Config) -> None:
    """Refuse, before the first step, what stands where the run writes its plot and its TensorBoard events, paths
    no option moves: a directory at training.png would fail the run at its end, after its last checkpoint."""
    plot, board = run_dir / metrics_lib.PLOT_FILE, run_dir / metrics_lib.TENSORBOARD_DIR
    if config.train.plot and plot.is_dir():
        raise ConfigError(f"{plot} is a directory where the run's plot goes; move it away or set train.plot=false.")
    for directory, what in ((board, "TensorBoard directory"), (run_dir / CACHE_DIR, "token cache"),
                            (run_dir / ckpt.DAMAGED_DIR, "directory for damaged checkpoints")):
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"{directory} is a file where the run's {what} goes; move it away.")


def train(config: Config, run_dir: Path, *, resume: bool = False, overwrite: bool = False,
          init_weights: tuple | None = None, log: Callable[[str], None] = print,
          progress: bool = True) -> RunSummary:
    """Train `config` in `run_dir`. `init_weights=(params, state)` starts from given weights (fine-tuning): the
    config's model, checked by `transformer.check_weights`.

    The plan's fit check comes first, before the run directory exists: a refused run leaves nothing behind."""
    log = log if jax.process_index() == 0 else (lambda message: None)
    if init_weights is not None:
        transformer.check_weights(config, *init_weights)
    # A resumed run keeps its saved layout but its mesh: train.auto_fit may then only choose parallel.*.
    config = setup_lib.fit_check(config, log=log,
                                 keep=frozenset(LAYOUT_KEYS) - RESUMABLE_CHANGES if resume else frozenset())
    return _train(config, run_dir, resume=resume, overwrite=overwrite, init_weights=init_weights, log=log,
                  progress=progress)


@run_lock.holds_run_dir
def _train(config: Config, run_dir: Path, *, resume: bool, overwrite: bool, init_weights: tuple | None,
           log: Callable[[str], None], progress: bool) -> RunSummary:
    run_dir = Path(run_dir)
    # With several processes, process 0 alone writes the run directory (config, tokenizer, corpus cache,
    # metrics); the others wait for it, then read. Checkpoints are written by all (orbax coordinates them).
    primary = jax.process_index() == 0
    # A new run that fails before its first step (its data, its settings: a kernel this platform lacks, a layout
    # the step cannot take) leaves its directory as it found it: a config.json kept from it would make the
    # corrected command need --overwrite, and nothing in it is worth keeping.
    new = primary and not resume and _holds_nothing(run_dir)
    config, dataset = _open_run(config, run_dir, primary, resume=resume, overwrite=overwrite, log=log, new=new)
    run = _Run(config, run_dir, primary, log)
    try:
        return run.train(dataset, init_weights, resume=resume, progress=progress)
    except BaseException:
        if primary and new and not run.last_step:
            _clear_new_run(run_dir)
        elif primary and run.last_saved in (None, run.start):
            # A run --overwrite set aside is deleted only once the new run has a checkpoint (`_save`): until then
            # it goes back in place of the new one (nothing to do where none was set aside).
            overwrite_lib.put_back(run_dir)
        raise


class _Run:
    """A run whose directory is open: its state, steps, evaluations and checkpoints. How far it has come (`start`,
    `last_step`, `last_saved`) is what `_train`'s clean-up after a failure reads."""

    def __init__(self, config: Config, run_dir: Path, primary: bool, log: Callable[[str], None]):
        self.config, self.run_dir, self.primary, self.log = config, run_dir, primary, log
        self.start, self.last_step, self.last_saved, self.stopped_by = 0, None, None, None
        self.eval_losses: list[tuple[int, float]] = []
        self.writer = None
        self.bar = _NoBar(log=log)
        self.dropped = _DropCounter(config)
        self.guard = _NonfiniteGuard(config.train.max_nonfinite_steps)
        self.router_watch = metrics_lib.RouterWatch(config)

    def train(self, dataset, init_weights: tuple | None, *, resume: bool, progress: bool) -> RunSummary:
        tc = self.config.train
        setup = setup_lib.build(self.config)
        state, self.start = _restore(setup, self.run_dir, init_weights, resume, self.log)
        _describe(self.config, setup, self.start, self.log)
        self.evaluate = _evaluator(self.config, setup, dataset)
        # A resumed run recomputes every step after its checkpoint: their old records go, so each step appears once.
        kept = (metrics_lib.keep_records_through(self.run_dir, self.start if self.start else -1)
                if self.primary and resume else [])
        self.eval_losses = [(r["step"], r["eval_loss"]) for r in kept if r.get("eval_loss") is not None]
        self.last_step, self.last_saved = self.start, (self.start or None)
        self.writer = metrics_lib.MetricsWriter(self.run_dir) if self.primary else None
        # Caught from the opening evaluation until train() returns, so that a signal while stopping cannot cut it short.
        with _StopSignals(tc.stop_signal_names) as signals:
            try:
                if self.start == 0:
                    self._evaluate(state, 0)
                self.bar = _progress_bar(self.start, tc.steps, progress and self.primary, self.log)
                wall_start = time.perf_counter()
                to_global = lambda b: setup_lib.global_batch(b, setup.batch_sharding, tc.batch_size)
                with ckpt.manager(self.run_dir, keep=tc.keep_checkpoints) as mngr, dataset.prefetch(
                        self.start, tc.batch_size, tc.steps, transform=to_global, **_process()) as batches:
                    self._steps(setup.step, state, batches, mngr, signals)
            finally:
                self.bar.close()
                if self.writer is not None:
                    self.writer.close()
            if self.primary and tc.plot:
                metrics_lib.plot_run(self.run_dir)
        return RunSummary(self.run_dir, self.start, max(self.start, self.last_step), self.eval_losses,
                          time.perf_counter() - wall_start, self.dropped.total, self.stopped_by)

    def _steps(self, step_fn, state: TrainState, batches, mngr, signals: "_StopSignals") -> None:
        """Train from `start` to `train.steps`, or to the step where a stop signal is agreed."""
        tc = self.config.train
        throughput = _Throughput(self.config)
        for step in range(self.start, tc.steps):
            state, step_metrics = step_fn(state, next(batches))
            self.guard.add(step_metrics["nonfinite"])
            self.dropped.add(step_metrics["tokens_dropped"])
            throughput.add(tc.batch_size * tc.seq_len)
            done = self.last_step = step + 1
            logged = done % tc.log_every == 0 or done == tc.steps
            evaluated = done % tc.eval_every == 0 or done == tc.steps
            saved = done % tc.checkpoint_every == 0 or done == tc.steps
            host_waits = logged or evaluated or saved  # the steps where the host reads from the device anyway
            if logged:
                self._log(_step_record(done, jax.device_get(step_metrics), throughput.take()))
            self.bar.update(1)
            if host_waits:
                self._check(done)
            if evaluated:
                self._evaluate(state, done)
            if saved:
                self.last_saved = _save(mngr, done, state, self.last_saved, self.run_dir)
            self.stopped_by = _agreed_stop(signals.received, host_waits)
            if self.stopped_by and done < tc.steps:
                if not saved:
                    self._check(done)
                    self.last_saved = _save(mngr, done, state, self.last_saved, self.run_dir)
                self.bar.close()
                self.log(f"dropless: stopped by {self.stopped_by} at step {done}; checkpoint {done} written; "
                         "resume with --resume")
                return
            self.stopped_by = None

    def _log(self, record: dict) -> None:
        _write(self.writer, record)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                             load=f"{record['max_expert_load']:.2f}")
        for line in self.router_watch.update(record) if self.primary else ():
            self.bar.write(line)

    def _check(self, done: int) -> None:
        """The steps' flags and drop counts up to `done`, read where the host waits for the device anyway."""
        self.guard.check(done, self.last_saved, self.run_dir)
        self.dropped.check(done)

    def _evaluate(self, state: TrainState, done: int) -> None:
        self.eval_losses.append((done, self.evaluate(state)))
        _write(self.writer, {"step": done, "eval_loss": self.eval_losses[-1][1]})
        self.bar.write(f"dropless: step {done} held-out loss {self.eval_losses[-1][1]:.4f}")


class _StopSignals:
    """While training, the signals of `train.stop_signals` ask the loop to stop after the current step instead of
    killing the process. Only the first one counts; later ones are ignored, so that a checkpoint being written
    finishes. Handlers go in only on the main thread (Python delivers signals there alone) and the previous
    ones come back on exit."""

    def __init__(self, names: tuple[str, ...]):
        self.names, self.received, self._previous = names, None, {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in self.names:
                number = signal.Signals[name]
                self._previous[number] = signal.signal(number, self._catch)
        return self

    def _catch(self, number, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(number).name

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def _agreed_stop(received: str | None, host_waits: bool) -> str | None:
    """The signal that stops every process at this step, or None. One process stops at once; several agree
    with an all-gather of one integer, only at steps where the host waits for the device anyway, and all take
    the same answer (the signal of the lowest-numbered process that got one)."""
    if jax.process_count() == 1:
        return received
    if not host_waits:
        return None
    numbers = np.ravel(multihost_utils.process_allgather(np.int32(signal.Signals[received] if received else 0)))
    return next((signal.Signals(int(n)).name for n in numbers if n), None)


class _DropCounter:
    """The (token, expert) assignments each step did not compute: summed over every step of the run and held to
    the dropless invariant on each, logged or not. The per-step device counts wait in a list and are read where the
    host waits for the device anyway, as _NonfiniteGuard's flags are."""

    def __init__(self, config: Config):
        self.config, self.pending, self.total = config, [], 0

    def add(self, tokens_dropped: jax.Array) -> None:
        self.pending.append(tokens_dropped)

    def check(self, done: int) -> None:
        """Add the steps up to `done` (the last step added); raise on a drop where the path is dropless."""
        counts, self.pending = jax.device_get(self.pending), []
        for step, count in enumerate(counts, done - len(counts) + 1):
            self.total += int(count)
            _check_nothing_dropped(self.config, {"step": step, "tokens_dropped": int(count)})


class _NonfiniteGuard:
    """Counts the steps in a row whose loss or gradient norm was not finite. The per-step device flags wait in a
    list and are read only where the host waits for the device anyway."""

    def __init__(self, limit: int):
        self.limit, self.pending, self.streak, self.first_bad = limit, [], 0, None

    def add(self, nonfinite: jax.Array) -> None:
        self.pending.append(nonfinite)

    def check(self, done: int, last_saved: int | None, run_dir: Path) -> None:
        """Raise TrainingDiverged if the streak reached the limit by step `done` (the last step added)."""
        flags, self.pending = jax.device_get(self.pending), []
        for step, flag in enumerate(flags, done - len(flags) + 1):
            self.streak, self.first_bad = (self.streak + 1, self.first_bad or step) if flag else (0, None)
            if self.streak >= self.limit and self.first_bad == 1:  # the first loss precedes every update
                raise TrainingDiverged(
                    f"The loss or gradient norm was not finite from step 1, before any update was applied "
                    f"({self.streak} steps in a row, train.max_nonfinite_steps={self.limit}), so the learning rate "
                    "is not the cause; check the model's settings (model.*, moe.*) and the data.")
            if self.streak >= self.limit:
                fix = (f"the last good checkpoint is step {last_saved} in {ckpt.checkpoint_dir(run_dir)}, which "
                       "--resume continues with the same settings; check the data, or start a new run with a lower "
                       "train.learning_rate" if last_saved else
                       "no checkpoint was written yet; lower train.learning_rate or check the data and start the run "
                       "again with --overwrite (or in another --run-dir)")
                raise TrainingDiverged(
                    f"Training diverged: the loss or gradient norm was not finite at steps {self.first_bad}-{step} "
                    f"({self.streak} in a row, none applied, train.max_nonfinite_steps={self.limit}); {fix}.")


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _save(mngr, step: int, state: TrainState, last_saved: int | None, run_dir: Path) -> int:
    """Checkpoint `step` and return it, refusing weights that are not finite (one scalar read, beside the save's
    own wait), so that a bad checkpoint never rotates a good one away."""
    if not bool(_all_finite((state.params, state.model_state))):
        good = f"step {last_saved} in {ckpt.checkpoint_dir(run_dir)}" if last_saved else "none"
        raise TrainingDiverged(f"The weights at step {step} are not finite, so no checkpoint of it is written; the "
                               f"last good checkpoint is {good}; lower train.learning_rate or check the data.")
    ckpt.save(mngr, step, state.params, state.model_state, state.opt_state)
    if jax.process_index() == 0:
        overwrite_lib.discard(run_dir)  # a run --overwrite set aside: the new one has a checkpoint now
    return step


def _process() -> dict:
    return {"process_index": jax.process_index(), "process_count": jax.process_count()}


def _open_run(config: Config, run_dir: Path, primary: bool, *, resume: bool, overwrite: bool, log, new: bool):
    """(the run's config, its token dataset): process 0 prepares the directory, the others read it after.

    A run that --overwrite set aside stays until the new run has written its first checkpoint (`_save`; `_train`
    puts it back after any failure before that): a process that cannot load the new run's data (a run directory not
    on a filesystem all hosts share, a corpus missing on its host) makes process 0 put the old run back, and every
    process ends with one line. A `new` run's directory (process 0's, empty before) is emptied instead."""
    def trained() -> bool:  # weights that belong to the run's tokenizer (after prepare_run_dir: it may put some back)
        return resume and ckpt.reached_a_checkpoint(run_dir)

    undo = (lambda: _clear_new_run(run_dir)) if new else (lambda: overwrite_lib.put_back(run_dir))
    if primary:
        config = prepare_run_dir(run_dir, config, resume=resume, overwrite=overwrite, log=log)
        log(f"dropless: run directory {run_dir.resolve()}")  # before the data, whose tokenizer may take a while
        try:
            dataset, _ = load_token_dataset(config.data, config.model.vocab_size, config.train.seq_len, run_dir,
                                            log=log, resume=trained())
        except BaseException:
            undo()
            raise
    _sync_processes("dropless: run directory ready")
    failure = None
    if not primary:
        try:
            config = _read_prepared_config(run_dir)  # as process 0 resolved it (the schedule horizon)
            dataset, _ = load_token_dataset(config.data, config.model.vocab_size, config.train.seq_len, run_dir,
                                            resume=trained())
        except Exception as err:  # raised below, once the processes agree
            failure = err
    failed, process = ckpt.agreed_outcome(int(failure is not None))
    if failed:
        if primary:
            undo()
        raise failure or ConfigError(
            f"process {process} of {jax.process_count()} could not load the run's data (its own error line says "
            f"why){'; the run that --overwrite set aside is put back' if primary and overwrite else ''}.")
    return config, dataset


def _holds_nothing(run_dir: Path) -> bool:
    """Whether `run_dir` is new: missing, or holding only the lock this process has just taken."""
    return not run_dir.is_dir() or run_lock.holds_only_the_lock(run_dir)


def _clear_new_run(run_dir: Path) -> None:
    """Remove what a new run wrote in `run_dir` (its config, tokenizer, token cache) before it trained a step; the
    lock stays until its holder ends."""
    for path in run_dir.iterdir():
        if path.name == run_lock.LOCK_NAME:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _read_prepared_config(run_dir: Path) -> Config:
    """The config process 0 has just written to `run_dir`, read by another process."""
    if not (Path(run_dir) / "config.json").is_file():
        raise ConfigError(f"process {jax.process_index()} finds no config.json in {run_dir}, which process 0 has "
                          "just written: every process must see the same run directory; put --run-dir on a "
                          "filesystem that all hosts share.")
    return ckpt.load_run_config(run_dir)


def _restore(setup, run_dir: Path, init_weights: tuple | None, resume: bool, log) -> tuple[TrainState, int]:
    """(state, first step): the newest good checkpoint's when resuming (raises if there is none), else a fresh
    state (`init_weights`, where given) at 0. A resumed state is restored straight into its shapes and shardings:
    no initialised state is made only to be replaced."""
    if not resume:
        return setup_lib.init_state(setup, init_weights), 0
    like = jax.tree.map(lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
                        setup.state_shapes, setup.state_shardings)
    start, restored = ckpt.restore_latest(run_dir, {"params": like.params, "state": like.model_state},
                                          {"opt_state": like.opt_state, "step": 0}, log=log)
    step = jax.device_put(jnp.asarray(start, jnp.int32), setup.state_shardings.step)
    return TrainState(step, restored["model"]["params"], restored["optimizer"]["opt_state"],
                      restored["model"]["state"]), start


def _describe(config: Config, setup, start: int, log) -> None:
    """The run's opening lines after its data: how large, on what, with which kernels and dispatch."""
    executor = setup.executor
    total, active = transformer.param_counts(config)
    log(f"dropless: {total / 1e6:,.2f}M parameters, {active / 1e6:,.2f}M active per token; "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s), mesh {dict(setup.mesh.shape)}; "
        f"gmm={resolve_backend_name(config.moe.gmm_backend)}, "
        f"dispatch={executor.name}"
        + (", float8 rows towards the experts"
           if executor.mesh is not None and config.moe.dispatch_dtype == "float8" else ""))
    if start >= config.train.steps:
        log(f"dropless: the run is already at step {start} of {config.train.steps}; raise --steps to train further.")
    elif start:
        log(f"dropless: resuming from checkpoint {start}, to step {config.train.steps}")


def _evaluator(config: Config, setup, dataset) -> Callable[[TrainState], float]:
    """The held-out loss: the mean over the dataset's fixed evaluation batches."""
    tc = config.train
    eval_step = jax.jit(make_eval_step(config, setup.executor),
                        in_shardings=(setup.state_shardings.params, setup.state_shardings.model_state,
                                      setup.batch_sharding))
    eval_data = [setup_lib.global_batch(b, setup.batch_sharding, tc.batch_size)
                 for b in dataset.eval_batches(tc.eval_batches, tc.batch_size, **_process())]

    def evaluate(state: TrainState) -> float:
        losses = [eval_step(state.params, state.model_state, b) for b in eval_data]
        return float(np.mean(jax.device_get(losses)))
    return evaluate


class _Throughput:
    """Tokens and wall time since the last logged step, as the metrics' throughput fields."""

    def __init__(self, config: Config):
        self.flops_per_token = flops_lib.model_flops_per_token(config, config.train.seq_len)
        self.peak = metrics_lib.device_peak_tflops(jax.devices()[0].device_kind)
        self.start, self.tokens = time.perf_counter(), 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def take(self) -> dict:
        fields = metrics_lib.throughput(self.tokens, time.perf_counter() - self.start, self.flops_per_token,
                                        jax.device_count(), self.peak)
        self.start, self.tokens = time.perf_counter(), 0
        return fields


def _step_record(step: int, step_metrics: dict, throughput: dict) -> dict:
    """One metrics.jsonl line for a logged step."""
    step_metrics = metrics_lib.host_metrics(step_metrics)
    record = {"step": step, **{k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()  # router rows: [L, E]
                               for k, v in step_metrics.items()}, **throughput}
    for key in ("tokens_dropped", "dispatch_overflows", "rows_sent", "rows_sent_without_dedup", "nonfinite"):
        record[key] = int(step_metrics[key])
    return record


def _sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _write(writer, record: dict) -> None:
    if writer is not None:
        writer.write(record)


def _check_nothing_dropped(config: Config, record: dict) -> None:
    """The dropless invariant: outside the capacity baseline, no token is ever dropped."""
    if resolve_backend_name(config.moe.gmm_backend) != "capacity" and record["tokens_dropped"] != 0:
        raise RuntimeError(f"internal error: {record['tokens_dropped']} tokens dropped at step {record['step']} "
                           "on a dropless path; please report this bug.")


class _NoBar:
    """The progress bar's stand-in where there is none (--no-progress, or a process other than 0): each logged
    step's figures, which the bar would show, as a line of their own, and every line through `log`."""

    def __init__(self, start: int = 0, log: Callable[[str], None] = lambda message: None):
        self.step, self.log, self.figures = start, log, None

    def update(self, n):
        self.step += n
        if self.figures is not None:
            self.log(f"dropless: step {self.step} " + " ".join(f"{k}={v}" for k, v in self.figures.items()))
        self.figures = None

    def set_postfix(self, **figures):
        self.figures = figures

    def write(self, s):
        self.log(s)

    def close(self):
        pass


def _progress_bar(start: int, total: int, enabled: bool, log: Callable[[str], None]):
    """tqdm's bar on stderr, or where it is not `enabled` the logged steps' lines through `log`."""
    if not enabled:
        return _NoBar(start, log)
    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
