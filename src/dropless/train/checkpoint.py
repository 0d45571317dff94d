"""Checkpoints with orbax: atomic, the last few kept, restored with the shardings the caller asks for.

A run directory looks like
    RUN_DIR/config.json            the full Config of the run (dropless.core.config.save)
    RUN_DIR/tokenizer.json         the tokenizer (written by dropless.data)
    RUN_DIR/checkpoints/<step>/    one orbax checkpoint per saved step, with two items:
        model       {"params": ..., "state": ...}   what inference, export and fine-tuning need
        optimizer   {"opt_state": ..., "step": ...} what exact resumption needs (absent after an HF import)
orbax writes each step to a temporary directory and renames it when complete, so an interrupted save never
leaves a checkpoint that looks whole; `latest_step` only sees finished ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from dropless.core import config as config_lib
from dropless.models import transformer


class CheckpointError(ValueError):
    """A run directory or checkpoint that cannot be used; the message says why and what to do."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir).resolve() / "checkpoints"


def manager(run_dir: Path, keep: int | None = None, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only, read_only=read_only,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options, item_names=("model", "optimizer"))


def latest_step(run_dir: Path) -> int | None:
    if not checkpoint_dir(run_dir).is_dir():
        return None
    with manager(run_dir, read_only=True) as mngr:
        return mngr.latest_step()


def save(mngr: ocp.CheckpointManager, step: int, params, state, opt_state=None) -> None:
    """Save one step; blocks until the checkpoint is complete on disk."""
    items = {"model": ocp.args.StandardSave({"params": params, "state": state})}
    if opt_state is not None:
        items["optimizer"] = ocp.args.StandardSave({"opt_state": opt_state, "step": np.asarray(step, np.int64)})
    mngr.save(step, args=ocp.args.Composite(**items), force=True)
    mngr.wait_until_finished()


def _abstract(tree):
    """ShapeDtypeStructs (with shardings, where the leaves have them) describing `tree`."""
    def leaf(x):
        x = np.asarray(x) if isinstance(x, (int, float)) else x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(leaf, tree)


def restore(run_dir: Path, step: int, like_model, like_optimizer=None) -> dict[str, Any]:
    """Restore `step` into trees shaped (and sharded) like the given templates.

    `like_model` = {"params", "state"}; `like_optimizer` = {"opt_state", "step"} or None to skip it.
    Templates may be concrete arrays or ShapeDtypeStructs (e.g. from jax.eval_shape).
    """
    items = {"model": ocp.args.StandardRestore(_abstract(like_model))}
    if like_optimizer is not None:
        items["optimizer"] = ocp.args.StandardRestore(_abstract(like_optimizer))
    with manager(run_dir, read_only=True) as mngr:
        if step not in mngr.all_steps():
            raise CheckpointError(f"{checkpoint_dir(run_dir)} has no checkpoint for step {step}; "
                                  f"the saved steps are {sorted(mngr.all_steps()) or 'none'}.")
        if like_optimizer is not None and "optimizer" not in _item_names(mngr, step):
            raise CheckpointError(f"The checkpoint at step {step} in {run_dir} holds weights only (an import); "
                                  "start a new run from it with --init-from instead of --resume.")
        try:
            return dict(mngr.restore(step, args=ocp.args.Composite(**items)))
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"The checkpoint at step {step} in {run_dir} does not match this model's "
                                  f"parameters ({str(err).splitlines()[0][:160]}); check the run's config.json.") from None


def _item_names(mngr: ocp.CheckpointManager, step: int) -> set[str]:
    step_dir = checkpoint_dir(Path(mngr.directory).parent) / str(step)
    return {p.name for p in step_dir.iterdir() if p.is_dir()} if step_dir.is_dir() else set()


def load_run_config(run_dir: Path) -> config_lib.Config:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{run_dir} is not a dropless run directory (no config.json); "
                              "pass the directory a 'dropless train' or 'dropless convert' wrote.")
    return config_lib.load(path)


def save_model(run_dir: Path, config: config_lib.Config, params, state, step: int = 0) -> None:
    """Write a weights-only run directory (config.json + one checkpoint), e.g. after an HF import."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_lib.save(config, run_dir / "config.json")
    with manager(run_dir) as mngr:
        save(mngr, step, params, state)


def load_model(run_dir: Path, step: int | None = None):
    """(config, params, state) from a run directory's latest (or given) checkpoint, on the default device."""
    config = load_run_config(run_dir)
    step = latest_step(run_dir) if step is None else step
    if step is None:
        raise CheckpointError(f"{run_dir} has no finished checkpoint yet; train longer or pick another run.")
    like = jax.eval_shape(lambda: {"params": transformer.init_params(jax.random.key(0), config),
                                   "state": transformer.init_state(config)})
    model = restore(run_dir, step, like)["model"]
    return config, model["params"], model["state"]
