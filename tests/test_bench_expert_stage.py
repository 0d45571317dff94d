"""The expert-stage benchmark (`dropless bench gmm --stages`): its records, its check, its table, on the CPU."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from dropless.bench import expert_stage as stage
from dropless.bench import gmm as bench


def test_stage_records_and_table_from_bench_gmm(tmp_path, capsys):
    out = tmp_path / "gmm-cpu.json"
    assert bench.main(["--shapes", "", "--stages", "tiny", "--stage-paths", "default,fp8_blockwise",
                       "--out", str(out), "--batches", "1", "--table"]) == 0
    records = json.loads(out.read_text())
    assert [r["backend"] for r in records] == ["stage:dense", "stage:default", "stage:fp8_blockwise"]
    dense, default, fp8 = records
    assert dense["fwd_ms"] == dense["up_fwd_ms"] + dense["down_fwd_ms"] > 0
    for r in (default, fp8):
        assert r["error"] is None and r["device"] and r["commit"] is not None
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["fwdbwd_vs_dense"] == dense["fwdbwd_ms"] / r["fwdbwd_ms"]
        assert r["gemms_fwd_ms"] > 0 and r["gemms_fwdbwd_ms"] > 0
        assert r["outside_gemms_fwdbwd_ms"] == r["fwdbwd_ms"] - r["gemms_fwdbwd_ms"]
    assert default["max_rel_err"] < stage.STAGE_ERR_LIMIT
    assert 0 < fp8["max_rel_err"] < stage.FP8_STAGE_ERR_LIMIT  # e4m3 rounding is there, and bounded
    assert "| tiny | default |" in capsys.readouterr().out


def test_the_stage_gemms_alone_run_on_the_stage_permutation_layout():
    """The grouped GEMMs timed alone read the rows the stage's permutation writes: the T*K pairs end to end, or
    under FP8 each expert from a multiple of 128 (zeros between); their gate+up product on expert 0's rows is
    x · W[0] (to e4m3's rounding under FP8)."""
    spec = stage.STAGES["tiny"]
    x, _, experts = stage.operands(spec, 0)
    ids, _ = stage.routing(spec, 0)
    e0 = int((np.asarray(ids) == 0).sum())  # expert 0's rows come first
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    for path, limit in (("default", 1e-2), ("fp8_blockwise", 0.1)):
        gmm = stage.stage_gmm(path)
        (up_fwd, _, (x_MD, w, _)), (_, down_fb, (a_MF, w_down, dy_MD)) = stage.gemm_programs(gmm, x, ids, experts, 0)
        assert a_MF.shape == (x_MD.shape[0], spec.width) and dy_MD.shape == x_MD.shape
        if gmm.row_align == 1:
            assert x_MD.shape[0] == spec.rows
        else:
            assert x_MD.shape[0] % 128 == 0 and 0 < e0 < 128 and not np.asarray(x_MD[e0:128]).any()
        h = np.asarray(up_fwd(x_MD, w)[:e0], np.float64)
        assert rel(h, np.asarray(x_MD[:e0], np.float64) @ np.asarray(w[0], np.float64)) < limit
        _, dx, dw = down_fb(a_MF, w_down, dy_MD)
        assert dx.shape == a_MF.shape and dw.shape == w_down.shape


def test_routing_draws_distinct_experts_per_token_with_skewed_loads():
    spec = stage.STAGES["dsv3-e32"]
    ids, weights = stage.routing(spec, seed=0)
    ids = np.asarray(ids)
    assert ids.shape == (spec.tokens, spec.top_k) and (np.sort(ids, 1)[:, 1:] != np.sort(ids, 1)[:, :-1]).all()
    loads = np.bincount(ids.ravel(), minlength=spec.experts)
    assert loads.max() > 2 * loads.min() and np.asarray(weights).min() >= 0.5


def test_stage_check_catches_a_wrong_combine():
    spec = stage.STAGES["tiny"]
    x, dy, experts = stage.operands(spec, 0)
    ids, weights = stage.routing(spec, 0)
    _, fwdbwd = stage.stage_programs(stage.stage_gmm("default"), ids, weights)
    good = stage.check(spec, fwdbwd, x, dy, experts, ids, weights)
    assert max(good.values()) < stage.STAGE_ERR_LIMIT
    _, wrong = stage.stage_programs(stage.stage_gmm("default"), ids, weights * jnp.asarray([1.0, 0.5]))
    bad = stage.check(spec, wrong, x, dy, experts, ids, weights)
    assert min(bad.values()) > 0.05  # output and both gradients


def test_stage_check_catches_a_wrong_weight_gradient():
    """A stage whose output and input gradient are right but whose weight gradient is not (halved for one
    expert, or two experts' gradients swapped) fails the check's weight-gradient part alone."""
    spec = stage.STAGES["tiny"]
    x, dy, experts = stage.operands(spec, 0)
    ids, weights = stage.routing(spec, 0)
    _, fwdbwd = stage.stage_programs(stage.stage_gmm("default"), ids, weights)
    good = stage.check(spec, fwdbwd, x, dy, experts, ids, weights)
    assert set(good) == {"fwd", "dlhs", "drhs"} and max(good.values()) < stage.STAGE_ERR_LIMIT
    for wrong_grad in (lambda g: g.at[1].multiply(0.5), lambda g: g[jnp.asarray([1, 0, 2, 3])]):
        def wrong(x, experts, dy, wrong_grad=wrong_grad):
            y, dx, d_experts = fwdbwd(x, experts, dy)
            return y, dx, {**d_experts, "down": wrong_grad(d_experts["down"])}

        bad = stage.check(spec, wrong, x, dy, experts, ids, weights)
        assert bad["fwd"] == good["fwd"] and bad["dlhs"] == good["dlhs"] and bad["drhs"] > 0.05, bad
