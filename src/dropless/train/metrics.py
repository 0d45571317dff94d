"""Training metrics: throughput formulas, and the three sinks (metrics.jsonl, TensorBoard, a PNG at the end).

Definitions (also in docs/training.md):
    tokens_per_s       = global tokens in the logged steps / wall seconds they took
    tflops_per_device  = model_flops_per_token * tokens_per_s / device_count / 1e12
    mfu                = tflops_per_device / the device's dense bf16 peak (null where the peak is unknown, e.g. CPU)
`model_flops_per_token` is in `dropless.models.flops` (6 x active matmul parameters + the causal attention term).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tensorboardX import SummaryWriter

# Dense (non-sparse) bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s, by jax `device_kind`.
PEAK_BF16_TFLOPS = {
    "NVIDIA H200": 989.5,
    "NVIDIA H100 80GB HBM3": 989.5,
    "NVIDIA H100": 989.5,
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA B200": 2250.0,
}


def device_peak_tflops(device_kind: str) -> float | None:
    if device_kind in PEAK_BF16_TFLOPS:
        return PEAK_BF16_TFLOPS[device_kind]
    for name, peak in PEAK_BF16_TFLOPS.items():
        if device_kind.startswith(name):
            return peak
    return None


def throughput(tokens: int, seconds: float, flops_per_token: float, device_count: int,
               peak_tflops: float | None) -> dict[str, float | None]:
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    tflops = flops_per_token * tokens_per_s / device_count / 1e12
    return {"tokens_per_s": tokens_per_s, "tflops_per_device": tflops,
            "mfu": (tflops / peak_tflops) if peak_tflops else None}


class MetricsWriter:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, record: dict) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        step = int(clean["step"])
        for key, value in clean.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        self._file.close()
        self._tensorboard.close()


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


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
    with temporary.open("w") as file:
        file.write("".join(json.dumps(r) + "\n" for r in kept))
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    return kept


def plot_run(run_dir: Path) -> Path | None:
    """Write RUN_DIR/training.png: train and held-out loss, and expert load (max/mean), over steps."""
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    if not train and not evals:
        return None
    # matplotlib's object API renders without pyplot, so no global backend is chosen for the caller. It is imported
    # here, once a run has ended: importing it costs every `dropless` process 0.6 s on a CPU, most of them no plot.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    ax_loss, ax_load = fig.subplots(1, 2)
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
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=110)
    return out
