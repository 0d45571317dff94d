"""How benchmarks/results/gmm-h200.json was made: the device commands, and the merge of their outputs.

Two calls on one H200 (2026-11-30), each starting with the wheel install printed by
shared/device/prepare-wheels.sh (tokamax 0.0.17 on the machine's jax 0.11.2):

run 1 (commit e2cdb80):
  python3 -m dropless.bench.tune_gmm --bench-shapes <all 7 shapes> --out $OUT/gmm_configs.json --log $OUT/tune_log.json
  python3 -m dropless.bench.gmm --shapes <all 7> --configs $OUT/gmm_configs.json --out $OUT/gmm-h200.json
run 2 (commit bc1bd48):
  python3 -m dropless.bench.tune_gmm --bench-shapes dsv3-gate-up-e256,dsv3-down-e256 --products drhs ...
  python3 -m dropless.bench.gmm --shapes dsv3-gate-up-e32,dsv3-gate-up-e256,dsv3-down-e32,dsv3-down-e256 ...
  python3 -m dropless.bench.gmm --shapes mixtral-gate-up,qwen3-gate-up,qwen3-down --skews dirichlet --backends dense,dropless

Both runs' dense fwd+bwd references were invalid (run 1 scattered the weight gradient into all G experts; both
ran the backward dots in f32 because of preferred_element_type=f32; the benchmark now does neither), so every
ratio here is against the dense *forward* GEMM of the same run and shape: the same M x K x N bf16 matmul, at
the rate XLA/cuBLAS reaches on it. Run 2 is preferred where it measured a (shape, skew, path); run 1 fills
in the rest. Run 2's bench was cut by its time limit during dsv3-down-e32, so that shape's run-2 lines come
from its log. The raw outputs are in benchmarks/results/gmm-h200-raw/.

  python benchmarks/gmm_h200.py     # rewrites gmm-h200.json, gmm-h200.png and prints the BENCHMARKS.md table
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dropless.bench.gmm import SHAPES, markdown_table, write_chart

RESULTS = Path(__file__).resolve().parent / "results"
RAW = RESULTS / "gmm-h200-raw"
DENSE_NOTE = ("dense_tflops is the dense forward GEMM (M x K x N, bf16) of the same run and shape; the runs' "
              "dense fwd+bwd measurement was invalid (f32 backward), see benchmarks/gmm_h200.py")
LINE = re.compile(r"^(?P<shape>\S+) (?P<skew>\w+)\s+(?P<backend>\w+)\s+(?:fwd\s+(?P<fwd>[\d.]+) TF/s fwd\+bwd\s+"
                  r"(?P<fb>[\d.]+) TF/s .*err (?P<err>[\d.e+-]+)|FAILED: (?P<error>.*))$")
DENSE = re.compile(r"^(?P<shape>\S+): dense (?P<ms>[\d.]+) ms fwd \((?P<tf>\d+) TF/s\)")


def records_from_log(path: Path, run: int, commit: str, shapes: set[str]) -> list[dict]:
    """Records of the shapes whose JSON the run did not get to write, rebuilt from its log lines."""
    out, dense = [], {}
    for line in path.read_text().splitlines():
        if (d := DENSE.match(line)) and d["shape"] in shapes:
            dense[d["shape"]] = float(d["tf"])
            out.append({"shape": d["shape"], "skew": None, "backend": "dense", "fwd_ms": float(d["ms"]),
                        "fwd_tflops": float(d["tf"]), "fwdbwd_tflops": None, "max_rel_err": None, "error": None})
        elif (m := LINE.match(line)) and m["shape"] in shapes:
            rec = {"shape": m["shape"], "skew": m["skew"], "backend": m["backend"], "error": m["error"]}
            if m["error"] is None:
                rec |= {"fwd_tflops": float(m["fwd"]), "fwdbwd_tflops": float(m["fb"]), "max_rel_err": float(m["err"])}
            elif "relative error {" in m["error"]:
                errs = dict(re.findall(r"'(\w+)': ([\d.e+-]+)", m["error"]))
                rec["rel_err"] = {k: float(v) for k, v in errs.items()}
                rec["max_rel_err"] = max(rec["rel_err"].values())
                rec["error"] = f"relative error {rec['max_rel_err']:.3g} > 0.02: not timed"
            out.append(rec)
    for rec in out:
        s = SHAPES[rec["shape"]]
        rec |= {"m": s.m, "k": s.k, "n": s.n, "g": s.g, "device": "NVIDIA H200", "date": "2026-11-30",
                "commit": commit, "from_log": True}
    return out


def main() -> None:
    run1 = json.loads((RAW / "run1-bench.json").read_text())
    run2 = json.loads((RAW / "run2-bench-dsv3.json").read_text()) + json.loads((RAW / "run2-bench-other.json").read_text())
    run2 += records_from_log(RAW / "run2-bench.log", 2, "bc1bd48", {"dsv3-down-e32"})
    for run, recs in ((1, run1), (2, run2)):
        for r in recs:
            r["run"] = run
    key = lambda r: (r["shape"], r["skew"], r["backend"])
    have = {key(r) for r in run2 if not (r.get("error") and "jax_triton" in r["error"])}
    merged = run2 + [r for r in run1 if key(r) not in have and "jax_triton" not in (r.get("error") or "")]
    dense_fwd = {(r["run"], r["shape"]): r["fwd_tflops"] for r in run1 + run2 if r["backend"] == "dense"}
    out = []
    for r in merged:
        r = {k: v for k, v in r.items() if k not in ("dense_fwd_tflops", "fwd_vs_dense", "fwdbwd_vs_dense")}
        r["dense_tflops"] = dense_fwd[(r["run"], r["shape"])]
        r["dense_reference"] = DENSE_NOTE
        if r["backend"] == "dense":
            r["fwdbwd_tflops"] = r.pop("fwdbwd_ms", None) and None  # invalid in these runs
        if r.get("fwd_tflops") and r["backend"] != "dense":
            r["fwd_vs_dense"] = r["fwd_tflops"] / r["dense_tflops"]
            r["fwdbwd_vs_dense"] = r["fwdbwd_tflops"] / r["dense_tflops"]
        if r["backend"] == "xla" and r["g"] == 256:  # XLA's dense expansion: run 1's log shows the 224 GiB request
            r["error"] = "out of memory (XLA expands ragged_dot into an [M, G, K] temporary: 224 GiB)"
        if r.get("error") == "out of memory" and r["run"] == 1 and r["backend"] != "xla":
            r["error"] = "not measured (run 1's parallel XLA autotuning ran out of memory while compiling)"
        out.append(r)
    order = list(SHAPES)
    out.sort(key=lambda r: (order.index(r["shape"]), r["skew"] or "", r["backend"]))
    (RESULTS / "gmm-h200.json").write_text(json.dumps(out, indent=1) + "\n")
    write_chart(out, RESULTS / "gmm-h200.png")
    print(markdown_table(out))


if __name__ == "__main__":
    main()
