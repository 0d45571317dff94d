"""Training metrics: throughput formulas, the sinks (metrics.jsonl, router.bin, TensorBoard, a PNG at the end) and
the router watch.

Definitions (also in docs/training.md):
    tokens_per_s       = global tokens in the logged steps / wall seconds they took
    tflops_per_device  = model_flops_per_token * tokens_per_s / device_count / 1e12
    mfu                = tflops_per_device / the device's dense bf16 peak (null where the peak is unknown, e.g. CPU)
    expert_share[l][e] = the fraction of router row l's tokens that chose expert e (a row sums to K; balanced K/E)
    router_bias[l][e]  = the aux-loss-free correction bias after the step
    router_token_share[l], router_logit_token_share[l]
                       = the share of row l's selection scores' (scores + bias) / logits' variance over the step's
                         tokens that differs by token, each token's mean over experts removed first
                         (dropless.moe.balance.token_variance_share: 1 = no expert ahead for every token, 0 = every
                         token ranks the experts alike); in metrics.jsonl and as TensorBoard scalars per row
    router_logit_top_direction[l]
                       = the share of row l's logits' per-token variance along one direction in expert space
                         (dropless.moe.balance.top_direction_share: near 1 = tokens rank the experts in at most two
                         ways); the same sinks
    router_input_common_share[l]
                       = the share of row l's router input's mean square that is common to the step's tokens,
                         |mean_t h|² / mean_t |h|² (dropless.moe.balance.input_common_share: near 1 = every token's
                         input is nearly the same vector); the same sinks
    router_common_alignment[l]
                       = with moe.router_common_rate: |cosine| between row l's running input mean before the step's
                         update (what evaluation and inference use) and its input's mean over the step's tokens
                         (dropless.moe.balance.common_alignment: 1 = that direction is the step's common one; lower =
                         the running mean lags; 0 on a run's first step); the same sinks
`model_flops_per_token` is in `dropless.models.flops` (6 x active matmul parameters + the causal attention term).
The router rows are the MoE layers in model order, then the MTP modules' MoE blocks (`router_row_names`).

The router rows go to RUN_DIR/router.bin, not metrics.jsonl: at DeepSeek-V3's size they are 59 x 256 values each,
which as JSON made every logged line ~240 KB. router.bin holds one fixed-size record per logged step (`step` int64,
then `expert_share` and `router_bias`, each [rows, E] float16: 3 significant digits, a bias step of 1e-3 still
resolved up to |bias| ~ 2), described by RUN_DIR/router.json; `read_router` maps it as a NumPy structured array.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np

from dropless.core import config as config_lib
from dropless.core.config import Config
from dropless.core.files import refused, write_atomic
from dropless.moe.balance import top_direction_share

# Dense bf16 tensor-core peaks from NVIDIA's datasheets (half the "with sparsity" figure), by device kind; a kind
# that extends a listed name takes the longest such name's peak.
PEAK_BF16_TFLOPS = {
    "NVIDIA H200": 989.5,
    "NVIDIA H200 NVL": 835.5,
    "NVIDIA H100 80GB HBM3": 989.5,
    "NVIDIA H100": 989.5,
    "NVIDIA H100 NVL": 835.5,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA B200": 2250.0,
}


def device_peak_tflops(device_kind: str) -> float | None:
    names = [name for name in PEAK_BF16_TFLOPS if device_kind.startswith(name)]
    return PEAK_BF16_TFLOPS[max(names, key=len)] if names else None


def throughput(tokens: int, seconds: float, flops_per_token: float, device_count: int,
               peak_tflops: float | None) -> dict[str, float | None]:
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    tflops = flops_per_token * tokens_per_s / device_count / 1e12
    return {"tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
            "mfu": (tflops / peak_tflops) if peak_tflops else None}


def host_metrics(step_metrics: dict) -> dict:
    """A logged step's metrics as read on the host: the logits' covariance per router row (`router_logit_covariance`,
    [L, E, E], too large for metrics.jsonl) becomes `router_logit_top_direction` [L]."""
    out = {k: v for k, v in step_metrics.items() if k != "router_logit_covariance"}
    if "router_logit_covariance" in step_metrics:
        out["router_logit_top_direction"] = top_direction_share(step_metrics["router_logit_covariance"])
    return out


def router_row_names(config: Config) -> list[str]:
    """The names of the router rows of `expert_share` and `router_bias`: "layer i" for each MoE layer (i counts
    every layer), then "mtp k" for each MTP module with a MoE block."""
    m = config.model
    names = [f"layer {i}" for i, kind in enumerate(m.layer_types) if kind == "M"]
    return names + ([f"mtp {k}" for k in range(1, m.mtp_layers + 1)] if m.mtp_block == "moe" else [])


def load_ratios(shares_LE) -> np.ndarray:
    """[L] max/mean tokens per expert of each router row, from its expert shares."""
    shares_LE = np.asarray(shares_LE, np.float64)
    return shares_LE.max(-1) / np.maximum(shares_LE.mean(-1), 1e-12)


def expert_loads(shares_LE) -> tuple[np.ndarray, float]:
    """(load [..., L, E], its collapsed value E/K) from expert shares: load = share * E / K, 1 is balanced and E/K
    means every token of the row went to the same K experts (K recovered from the shares, whose rows sum to K)."""
    shares_LE = np.asarray(shares_LE, np.float64)
    num_experts = shares_LE.shape[-1]
    top_k = max(round(float(shares_LE.sum(-1).mean())), 1)
    return shares_LE * num_experts / top_k, num_experts / top_k


def _heat_image(values_LE, low: float, high: float, cell: int = 6) -> np.ndarray:
    """uint8 [L*cell, E*cell, 3] heatmap for TensorBoard, white at `low` to dark red at `high`."""
    level = np.clip((np.asarray(values_LE, np.float64) - low) / max(high - low, 1e-12), 0.0, 1.0)
    rgb = np.stack([1.0 - 0.45 * level, 1.0 - level, 1.0 - level], axis=-1)
    return (255 * np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1)).astype(np.uint8)


PLOT_FILE = "training.png"  # RUN_DIR/training.png: `plot_run`'s
TENSORBOARD_DIR = "tensorboard"  # RUN_DIR/tensorboard/: the TensorBoard events
ROUTER_KEYS = ("expert_share", "router_bias")
# Per-router-row values logged as one TensorBoard scalar per row: the variance shares and the running mean's
# alignment.
TOKEN_SHARE_KEYS = ("router_token_share", "router_logit_token_share", "router_logit_top_direction",
                    "router_input_common_share", "router_common_alignment")


def router_record_dtype(rows: int, experts: int) -> np.dtype:
    """One router.bin record: the logged step and its [rows, experts] shares and biases."""
    return np.dtype([("step", "<i8"), ("expert_share", "<f2", (rows, experts)), ("router_bias", "<f2", (rows, experts))])


def _router_header_shape(header: Path) -> tuple[int, int]:
    """(rows, experts) of a router.json; MetricsError naming the file and the fix when it is not one."""
    try:
        meta = json.loads(header.read_text())
        return int(meta["rows"]), int(meta["experts"])
    except (ValueError, KeyError, TypeError):
        raise MetricsError(f"{header} is not a router header; delete it and router.bin (the router history) "
                           "and run again.") from None


def read_router(run_dir: Path) -> np.ndarray | None:
    """RUN_DIR/router.bin as a read-only structured array [logged steps] (fields `step`, `expert_share`,
    `router_bias`), memory-mapped; None for a run without router rows. A torn last record is left out."""
    header, path = Path(run_dir) / "router.json", Path(run_dir) / "router.bin"
    if not header.is_file() or not path.is_file():
        return None
    dtype = router_record_dtype(*_router_header_shape(header))
    count = path.stat().st_size // dtype.itemsize
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype, mode="r", shape=(count,))


class _TensorBoard:
    """TensorBoard events written in the caller's thread (tensorboardX's summaries and event file format).

    tensorboardX's SummaryWriter hands events to a writer thread through a bounded queue; when that thread dies
    (a full disk), the queue fills and the next write blocks the training loop for good, stop signals included.
    Here a failed write raises where it happens, and `flush` after each record puts the events on disk."""

    def __init__(self, logdir: Path):
        # Imported here, by the one command that writes TensorBoard files: tensorboardX imports Google Cloud Storage
        # where it is installed (~0.6 s of every other command's start-up).
        from tensorboardX import summary
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2

        logdir.mkdir(parents=True, exist_ok=True)
        self._summary, self._event = summary, event_pb2.Event
        self._writer = EventsWriter(str(logdir / "events"))

    def _add(self, value, step: int) -> None:
        self._writer.write_event(self._event(wall_time=time.time(), step=step, summary=value))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._add(self._summary.scalar(tag, value), step)

    def add_image(self, tag: str, image: np.ndarray, step: int, dataformats: str = "HWC") -> None:
        self._add(self._summary.image(tag, image, dataformats=dataformats), step)

    def add_histogram(self, tag: str, values: np.ndarray, step: int) -> None:
        self._add(self._summary.histogram(tag, values, "auto"), step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricsWriter:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl and mirrors scalars to TensorBoard; the router
    rows (`expert_share`, `router_bias`) go to RUN_DIR/router.bin (module docstring) and become a TensorBoard
    heatmap image, per-row load scalars and bias histograms. A write the filesystem refuses (a full disk) is a
    MetricsError naming the step, the directory and the reason."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._router_file = None
        self._tensorboard = _TensorBoard(self.run_dir / TENSORBOARD_DIR)

    def write(self, record: dict) -> None:
        try:
            self._write(record)
        except OSError as err:
            raise MetricsError(f"could not write the metrics of step {record.get('step')} to {self.run_dir}: "
                               f"{err.strerror or err}; free space (or make it writable) and resume with "
                               "--resume.") from None

    def _write(self, record: dict) -> None:
        clean = {k: jsonable(v) for k, v in record.items() if k not in ROUTER_KEYS}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        step = int(clean["step"])
        for key, value in clean.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tensorboard.add_scalar(key, value, step)
        for key in TOKEN_SHARE_KEYS:  # one TensorBoard scalar per router row
            for row, share in enumerate(np.atleast_1d(np.asarray(clean.get(key, []), np.float64))):
                self._tensorboard.add_scalar(f"router/{key.removeprefix('router_')}/row_{row}", float(share), step)
        if record.get("expert_share") is not None:
            shares = np.asarray(record["expert_share"], np.float64)
            bias = record.get("router_bias")
            bias = np.full_like(shares, np.nan) if bias is None else np.asarray(bias, np.float64)
            self._append_router(step, shares, bias)
            self._router(shares, bias, step)
        self._tensorboard.flush()

    def _append_router(self, step: int, shares_LE: np.ndarray, bias_LE: np.ndarray) -> None:
        dtype = router_record_dtype(*shares_LE.shape)
        if self._router_file is None:
            header = self.run_dir / "router.json"
            meta = {"rows": shares_LE.shape[0], "experts": shares_LE.shape[1],
                    "format": "little-endian records: step int64, expert_share float16 [rows, experts], "
                              "router_bias float16 [rows, experts]; dropless.train.metrics.read_router"}
            if header.is_file():
                if _router_header_shape(header) != (meta["rows"], meta["experts"]):
                    raise MetricsError(f"{header} describes another model's router rows; delete it and router.bin "
                                       "and run again.")
            else:  # a kill leaves no header or a whole one
                write_atomic(header, json.dumps(meta) + "\n")
            self._router_file = (self.run_dir / "router.bin").open("ab")
            torn = self._router_file.tell() % dtype.itemsize  # a record cut short by a kill: drop it
            if torn:
                self._router_file.truncate(self._router_file.tell() - torn)
                self._router_file.seek(0, os.SEEK_END)
        entry = np.zeros((), dtype)
        entry["step"], entry["expert_share"], entry["router_bias"] = step, shares_LE, bias_LE
        self._router_file.write(entry.tobytes())
        self._router_file.flush()

    def _router(self, shares_LE: np.ndarray, bias_LE, step: int) -> None:
        load_LE, collapsed = expert_loads(shares_LE)  # the image's scale: balanced (1) to collapsed (E/K)
        self._tensorboard.add_image("router/expert_load", _heat_image(load_LE, 1.0, collapsed), step,
                                    dataformats="HWC")
        for row, ratio in enumerate(load_ratios(shares_LE)):
            self._tensorboard.add_scalar(f"router/max_load/row_{row}", float(ratio), step)
        if bias_LE is not None:
            for row, bias_E in enumerate(np.asarray(bias_LE, np.float64)):
                self._tensorboard.add_histogram(f"router/bias/row_{row}", bias_E, step)

    def close(self) -> None:
        """Close every sink; a sink the filesystem refuses to flush (the write that failed already said why) does
        not keep the others open."""
        for sink in (self._file, self._router_file, self._tensorboard):
            if sink is not None:
                try:
                    sink.close()
                except OSError:
                    pass


def jsonable(value):
    """`value` as a JSON file holds it: arrays as nested lists (6 digits), NumPy and JAX scalars as numbers, and a
    float that is not finite, alone or in an array, as null (JSON has no NaN or infinity)."""
    if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) > 0:  # an array field: nested lists, 6 digits
        array = np.round(np.asarray(value, np.float64), 6)
        return np.where(np.isfinite(array), array, None).tolist()
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RouterWatch:
    """Watches the logged `expert_share`s and returns a warning line when one expert of a router row has taken
    more than `moe.router_warn_share` of its tokens for `moe.router_warn_logs` logged steps in a row; once per
    episode (a row warns again only after dropping below the share)."""

    def __init__(self, config: Config):
        moe = config.moe
        self.share, self.logs = moe.router_warn_share, moe.router_warn_logs
        self.balanced = moe.num_experts_per_tok / moe.num_experts
        self.names = router_row_names(config)
        self._streaks: dict[int, tuple[int, int, int]] = {}  # row -> (expert, logged steps in a row, first step)

    def update(self, record: dict) -> list[str]:
        shares = record.get("expert_share")
        if shares is None:
            return []
        lines = []
        for row, share_E in enumerate(np.asarray(shares, np.float64)):
            expert = int(np.argmax(share_E))
            if share_E[expert] <= self.share:
                self._streaks.pop(row, None)
                continue
            same, count, first = self._streaks.get(row, (expert, 0, record["step"]))
            count, first = (count + 1, first) if same == expert else (1, record["step"])
            self._streaks[row] = (expert, count, first)
            if count == self.logs:
                name = self.names[row] if row < len(self.names) else f"router row {row}"
                lines.append(f"dropless: warning: {name} has sent {share_E[expert]:.0%} of its tokens to expert "
                             f"{expert} (balanced: {self.balanced:.0%}) in each of the last {count} logged steps, "
                             f"since step {first}; the router plots in training.png and TensorBoard show every "
                             "layer (docs/training.md, \"Router health\").")
        return lines


class MetricsError(ValueError):
    """A metrics.jsonl that cannot be read; the message names the file and the fix."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl, in order. A torn last line (a write cut short by a kill) is left
    out; an unreadable line before it is a MetricsError."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or "step" not in record:
            if number == len(lines):
                break
            raise MetricsError(f"{path} line {number} is not a metrics record; delete that line (or the file) "
                               "and run again.")
        records.append(record)
    return records


def keep_records_through(run_dir: Path, last_step: int) -> list[dict]:
    """Rewrite RUN_DIR/metrics.jsonl with its records of steps <= `last_step` only (what a run resumed from that
    step's checkpoint has not recomputed), a torn last line dropped; returns the kept records. The new file is
    written beside the old one and renamed over it, so a kill leaves one or the other, whole."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    kept = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
    temporary = path.with_name(path.name + ".tmp")
    try:
        with temporary.open("w") as file:
            file.write("".join(json.dumps(r) + "\n" for r in kept))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as err:
        raise refused(err, path, temporary) from None
    router = read_router(run_dir)
    if router is not None:  # its records of steps <= last_step, likewise (one truncation: whole records either way)
        keep = int(np.searchsorted(np.asarray(router["step"]), last_step, side="right"))
        size = keep * router.dtype.itemsize
        del router
        os.truncate(Path(run_dir) / "router.bin", size)
    return kept


def plot_run(run_dir: Path) -> Path | None:
    """Write RUN_DIR/training.png: train and held-out loss, and expert load (max/mean), over steps; with router
    rows (router.bin), also each row's max/mean load over steps, the worst row's per-expert load over steps and
    the router bias at the last logged step, as heatmaps."""
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    if not train and not evals:
        return None
    # matplotlib's object API renders without pyplot, so no global backend is chosen for the caller. It is imported
    # here, once a run has ended: importing it costs every `dropless` process 0.6 s on a CPU, most of them no plot.
    from matplotlib.figure import Figure

    routed = read_router(run_dir)
    routed = routed if routed is not None and len(routed) else None
    fig = Figure(figsize=(15, 7.6) if routed is not None else (10, 3.6))
    axes = fig.subplots(2, 3) if routed is not None else [fig.subplots(1, 2)]
    ax_loss, ax_load = axes[0][0], axes[0][1]
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="loss")
    ax_loss.legend()
    loads = [r for r in train if r.get("max_expert_load") is not None]
    if loads:
        ax_load.plot([r["step"] for r in loads], [r["max_expert_load"] for r in loads])
    ax_load.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_load.set(xlabel="step", ylabel="max / mean tokens per expert", title="expert load (worst layer)")
    if routed is not None:
        config_path = Path(run_dir) / "config.json"
        names = router_row_names(config_lib.load(config_path)) if config_path.is_file() else []
        _plot_router(fig, axes, routed, names)
    fig.tight_layout()
    out = Path(run_dir) / PLOT_FILE
    fig.savefig(out, dpi=110)
    return out


def _plot_router(fig, axes, routed: np.ndarray, names: list[str]) -> None:
    steps = [int(s) for s in routed["step"]]
    shares_NLE = np.asarray(routed["expert_share"], np.float64)
    num_rows, num_experts = shares_NLE.shape[1:]
    if len(names) != num_rows:
        names = [f"row {row}" for row in range(num_rows)]
    load_NLE, collapsed = expert_loads(shares_NLE)
    extent = dict(aspect="auto", interpolation="nearest", origin="lower", cmap="Reds")
    half = (steps[-1] - steps[0]) / (2 * (len(steps) - 1)) if len(steps) > 1 else 0.5  # cells centred on steps
    span = [steps[0] - half, steps[-1] + half, -0.5, num_rows - 0.5]
    ratio_NL = load_NLE.max(-1)
    image = axes[0][2].imshow(ratio_NL.T, extent=span, vmin=1.0, vmax=collapsed, **extent)
    axes[0][2].set(xlabel="step", title="max / mean load per layer")
    fig.colorbar(image, ax=axes[0][2])
    worst = int(np.argmax(ratio_NL[-1]))
    image = axes[1][0].imshow(load_NLE[:, worst].T, extent=[*span[:2], -0.5, num_experts - 0.5],
                              vmin=0.0, vmax=collapsed, **extent)
    axes[1][0].set(xlabel="step", ylabel="expert", title=f"expert load of {names[worst]} (worst at the end)")
    fig.colorbar(image, ax=axes[1][0])
    axes[1][1].plot(steps, np.sort(load_NLE[:, worst], axis=-1)[:, ::-1][:, :3])
    axes[1][1].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[1][1].set(xlabel="step", ylabel="load (1 = balanced)", title=f"{names[worst]}: its three busiest experts")
    bias_LE = np.asarray(routed["router_bias"][-1], np.float64)
    if np.isfinite(bias_LE).all():
        limit = max(float(np.abs(bias_LE).max()), 1e-9)
        image = axes[1][2].imshow(bias_LE, aspect="auto", interpolation="nearest", origin="lower", cmap="RdBu_r",
                                  vmin=-limit, vmax=limit)
        axes[1][2].set(xlabel="expert", title=f"router bias at step {steps[-1]}")
        fig.colorbar(image, ax=axes[1][2])
    else:
        axes[1][2].set_axis_off()
    if num_rows <= 32:  # name the rows where the labels fit
        for ax in (axes[0][2], axes[1][2]):
            ax.set_yticks(range(num_rows), names)
