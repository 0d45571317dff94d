"""The benchmarks' tables and charts: the Markdown tables BENCHMARKS.md shows and the PNG charts beside them.

Each function reads only the records a benchmark wrote (the JSON's own keys), so a table or chart can be made
again from a results file. matplotlib is imported when a chart is drawn, not with this module: `bench ep` and
`bench scale` print tables and draw nothing, and a bare GPU machine without matplotlib still gets the ladder's
JSON and table (`dropless bench step --chart` redraws its PNG elsewhere). The console summaries of `dropless plan`
and `dropless profile` stay with their commands.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dropless.bench.harness import REL_ERR_LIMIT


def _pyplot():
    """matplotlib's pyplot on the file-only backend (no display on a GPU machine)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------ bench gmm

def gmm_chart(records: list[dict], path: Path, backends: tuple[str, ...], skew: str = "dirichlet") -> None:
    """Bar chart: fwd+bwd TFLOP/s per shape and path at one skew, with the dense matmul of equal FLOPs."""
    plt = _pyplot()
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    paths = [b for b in backends if any(r["backend"] == b for r in records)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 4.5))
    width = 0.8 / len(paths)
    for i, path_name in enumerate(paths):
        values = []
        for s in shapes:
            rec = next((r for r in records if r["shape"] == s and r["backend"] == path_name
                        and (r["skew"] == skew or path_name == "dense")), None)
            rec = rec or {}
            values.append(rec.get("fwdbwd_tflops") or (rec.get("fwd_tflops") if path_name == "dense" else 0.0) or 0.0)
        label = "dense GEMM, same FLOPs" if path_name == "dense" else path_name
        ax.bar(np.arange(len(shapes)) + (i - (len(paths) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(np.arange(len(shapes)), shapes, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("forward+backward TFLOP/s")
    device = records[0].get("device", "") if records else ""
    ax.set_title(f"Grouped GEMM fwd+bwd, {skew} group sizes, {device}")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def gmm_markdown(records: list[dict], skews, backends: tuple[str, ...]) -> str:
    """The BENCHMARKS.md table: per shape and skew, TFLOP/s of each path and our path's share of dense."""
    lines = ["| shape | skew | dense fwd / fwd+bwd | xla | tokamax default | tokamax fwd-tuned | **dropless** (default) | "
             "dropless / dense (fwd+bwd) | capacity 1.25 (drops) |", "|" + " --- |" * 9]
    num = lambda v: "-" if v is None else f"{v:.0f}"

    def cell(r):
        if r is None:
            return "n/a"
        err = r.get("max_rel_err")
        if r.get("error"):
            if err is not None and err > REL_ERR_LIMIT:  # name the product that is wrong, where known
                per = r.get("rel_err") or {}
                worst = f"{max(per, key=per.get)} " if per else ""
                return f"wrong ({worst}err {err:.1%})"
            if r["error"].startswith("not measured"):
                return "not measured"
            return "OOM" if "out of memory" in r["error"] else r["error"][:60]
        flag = f" (err {err:.1%})" if err is not None and err > 5e-3 else ""
        return f"{num(r['fwd_tflops'])} / {num(r['fwdbwd_tflops'])}{flag}"

    for s in dict.fromkeys(r["shape"] for r in records):
        dense = next((r for r in records if r["shape"] == s and r["backend"] == "dense"), None)
        for skew in skews:
            pick = {b: next((r for r in records if r["shape"] == s and r["skew"] == skew and r["backend"] == b), None)
                    for b in backends}
            if not any(pick.values()):
                continue
            ours = pick["dropless"]
            ratio = f"**{ours['fwdbwd_vs_dense']:.0%}**" if ours and ours.get("fwdbwd_vs_dense") else "n/a"
            lines.append(f"| {s} | {skew} | {cell(dense)} | {cell(pick['xla'])} | {cell(pick['tokamax_default'])} | "
                         f"{cell(pick['tokamax_fwd_tuned'])} | {cell(ours)} | {ratio} | {cell(pick['capacity'])} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ bench ep

def ep_markdown(records: list[dict]) -> str:
    """Per strategy and routing: the layer's time, weak-scaling efficiency, communication and rows sent."""
    lines = ["| strategy | routing | layer fwd+bwd (ms) | weak-scaling efficiency (rounds) | communication (ms, share; "
             "of it waiting for the other GPU) | "
             "useful GB/s per device | rows sent per device (without dedup) | overflowed |", "|" + " --- |" * 8]
    for r in records:
        if r["strategy"] == "single-device":
            device = "1 device" + (f", {r['xla']}" if r.get("xla", "none") != "none" else "")
            lines.append(f"| {device} | {r['skew']} | {r['layer_ms']:.2f} | 1.00 | - | - | - | - |")
            continue
        gbps = f"{r['useful_GBps_per_device']:.0f}" if "useful_GBps_per_device" in r else "-"
        strategy = r["strategy"] + (f" ({r['chosen']})" if r["strategy"] == "auto" else "")
        strategy += f", {r['chunks']} chunks" if r.get("chunks", 1) > 1 else ""
        strategy += f", {r['dispatch_dtype']} dispatch" if r.get("dispatch_dtype", "compute") != "compute" else ""
        strategy += f", {r['xla']}" if r.get("xla", "none") != "none" else ""
        strategy += " (not applied)" if r.get("pgle", "").startswith("not applied") else ""
        low, high = r["efficiency_range"]
        waiting = f" ({r['comm_waiting_ms']:.2f} waiting)" if r.get("comm_waiting_ms") else ""
        lines.append(f"| {strategy} | {r['skew']} | {r['layer_ms']:.2f} | {r['weak_scaling_efficiency']:.3f} "
                     f"({low:.3f}-{high:.3f}) | "
                     f"{r['comm_ms']:.2f}, {100 * r['comm_share']:.1f}%{waiting} | {gbps} | "
                     f"{r['rows_sent_per_device']:.0f} ({r['rows_sent_without_dedup_per_device']:.0f}) | "
                     f"{r['overflowed']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ bench scale

def scale_markdown(rows: list[dict]) -> str:
    """Per mesh and dispatch strategy: the step's throughput, weak-scaling efficiency and communication."""
    lines = ["| GPUs | mesh | dispatch | step ms | tokens/s per GPU | model TFLOPS per GPU | efficiency | "
             "communication share | rows sent per GPU (without dedup) | overflows | dropped |", "|" + " --- |" * 11]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['devices']} | {r['mesh']} | {r['strategy']} | {r['status']} |" + " |" * 7)
            continue
        share = "-" if r["comm_share"] is None else f"{100 * r['comm_share']:.1f}%"
        efficiency = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(f"| {r['devices']} | {r['mesh']} | {r['strategy']} | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s_per_device']:,.0f} | {r['model_tflops_per_device']:.3g} | {efficiency} | {share} | "
                     f"{r['rows_sent_per_device']:,.0f} ({r['rows_sent_without_dedup_per_device']:,.0f}) | "
                     f"{r['dispatch_overflows']} | {r['tokens_dropped']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the ladder

def ladder_markdown(rungs: list[dict], dense_tflops: float | None = None) -> str:
    """The ladder as a Markdown table."""
    def num(value, fmt: str, unit: str = "") -> str:
        return "" if value is None else format(value, fmt) + unit

    header = ("| rung | what | step ms | tokens/s/GPU | model TFLOPS/GPU | vs dense | MFU (peak) | peak GiB "
              "| dropped | speed-up |")
    lines = [header, "|" + " --- |" * 10]
    for r in rungs:
        if r.get("status") != "ok":
            lines.append(f"| {r['rung']} | {r['what']} | {r.get('status')} |" + " |" * 7)
            continue
        dropped = f"{r['tokens_dropped']:,} ({100 * r['dropped_fraction']:.1f}%)" if r.get("tokens_dropped") else "0"
        lines.append(
            f"| {r['rung']} | {r['what']}{_chosen(r)} | {r['step_ms']:.1f} | {r['tokens_per_s_per_device']:,.0f} "
            f"| {r['model_tflops_per_device']:.3g} | {num(r.get('mfu_vs_measured_dense') and 100 * r['mfu_vs_measured_dense'], '.0f', '%')} "
            f"| {num(r.get('mfu_vs_datasheet_peak') and 100 * r['mfu_vs_datasheet_peak'], '.0f', '%')} "
            f"| {num(r.get('peak_device_gib'), '.1f')} | {dropped} | {num(r.get('speedup_vs_rung1'), '.2f', 'x')} |")
    if dense_tflops:
        lines.append(f"\nDense bf16 matmul measured in the same run: {dense_tflops:.0f} TFLOP/s.")
    return "\n".join(lines)


def _chosen(r: dict) -> str:
    if r["rung"] == 5 and r.get("chosen"):
        loop = "" if r["chosen"].get("train.scan_layers", True) else ", unrolled"
        return f" (remat={r['chosen']['train.remat']}{loop})"
    if r["rung"] == 7 and r.get("key", "").startswith("7:"):
        return f" ({r['key'][2:]})"
    if r["rung"] == 8:
        variant = "" if r.get("key", "8") == "8" else f"{r['key'][2:]}, "
        return f" ({variant}{r['overrides'].get('train.batch_size')} seq. global)"
    return ""


def ladder_chart(result: dict, path: Path) -> Path:
    """A bar chart of model TFLOPS per GPU per rung, with the dense rate and the 60% target."""
    plt = _pyplot()
    rungs = [r for r in result["ladder"] if r.get("status") == "ok"]
    labels = [f"{r['rung']}. {r['what']}" for r in rungs]
    values = [r["model_tflops_per_device"] for r in rungs]
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(rungs) + 2.0))
    bars = ax.barh(labels[::-1], values[::-1], color="#4C72B0")
    for bar, r in zip(bars, rungs[::-1]):
        if r.get("speedup_vs_rung1"):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['speedup_vs_rung1']:.1f}x",
                    va="center", fontsize=9)
    dense = result.get("dense_tflops")
    if dense:
        ax.axvline(dense, color="grey", ls="--", lw=1, label=f"dense bf16 matmul, measured ({dense:.0f})")
        ax.axvline(0.6 * dense, color="#C44E52", ls=":", lw=1, label="target: 60% of dense")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(rungs)), ncol=2, fontsize=8)
    env = result.get("environment", {})
    ax.set(xlabel="model TFLOPS per GPU", title=f"{result.get('preset')} on {env.get('device')} "
           f"({env.get('date')}, {env.get('commit')})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
