"""The device scripts in benchmarks/ run only on GPUs, so CI cannot run them; it can check that every name they
import from dropless still exists, so that a rename in the library breaks here rather than on the device."""

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("**/*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_script_imports_exist(script):
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dropless"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{script.relative_to(BENCHMARKS)} imports {alias.name} from {node.module}, which has no such name"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dropless"):
                    importlib.import_module(alias.name)


def test_sass_dump_counts_ptx_and_sass_instructions(tmp_path):
    """benchmarks/fp8/sass_dump.py's parsers on dump-shaped text: SASS lines by opcode, PTX lines by full opcode
    (directives and comments left out), ptxas's register and spill lines kept."""
    import sys
    sys.path.insert(0, str(BENCHMARKS / "fp8"))
    import sass_dump

    (tmp_path / "k.ptx").write_text(".version 8.4\n// comment\n\tfma.rn.f32 %f3, %f1, %f2, %f3;\n"
                                    "@%p1 bra $L__BB0_2;\n\twgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                                    "{%f1}, %rd1, %rd2, 1, 1, 1;\n\tfma.rn.f32 %f4, %f1, %f2, %f4;\n")
    (tmp_path / "k.sass").write_text("        /*0a40*/                   FFMA R0, R1, R2, R0 ;\n"
                                     "        /*0a50*/              @!P0 HGMMA.64x128x32.F32.E4M3 R24, gdesc ;\n")
    (tmp_path / "k.ptxas").write_text("ptxas info    : Used 168 registers, used 1 barriers\n"
                                      "ptxas info    : 0 bytes stack frame, 0 bytes spill stores\nother\n")
    assert sass_dump.count_ptx_opcodes(tmp_path) == {
        "fma.rn.f32": 2, "bra": 1, "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3": 1}
    assert sass_dump.count_opcodes(tmp_path) == {"FFMA": 1, "HGMMA": 1}
    assert sass_dump.ptxas_report(tmp_path) == ["ptxas info    : Used 168 registers, used 1 barriers",
                                                "ptxas info    : 0 bytes stack frame, 0 bytes spill stores"]


def test_router_projection_probe_patches_a_route_the_layer_can_call():
    """benchmarks/router_projection_probe.py replaces the layer's route: the MoE layer must still call it (its
    keywords follow route's), and the router then sees the batch's mean direction removed."""
    import sys
    import jax.numpy as jnp
    import numpy as np

    import dropless.moe.layer as moe_layer
    from dropless.core.config import MoEConfig
    from dropless.moe import init_moe

    sys.path.insert(0, str(BENCHMARKS))
    import router_projection_probe

    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2, expert_intermediate_size=4, num_shared_experts=0,
                    gmm_backend="xla")
    params = init_moe(__import__("jax").random.key(0), 8, cfg, 0.5)
    x = np.random.default_rng(0).normal(size=(2, 3, 8)).astype(np.float32) + 5.0
    original = moe_layer.route
    try:
        moe_layer.route = router_projection_probe._projected_route
        _, stats = moe_layer.moe_layer(params, None, x, cfg, compute_dtype=jnp.float32)
    finally:
        moe_layer.route = original
    _, plain = moe_layer.moe_layer(params, None, x, cfg, compute_dtype=jnp.float32)
    assert int(stats.tokens_per_expert.sum()) == 12
    assert not np.array_equal(np.asarray(stats.logit_moments), np.asarray(plain.logit_moments))


def test_loss_parity_merge_keeps_other_modes_of_a_record_with_the_same_settings(tmp_path, monkeypatch):
    """benchmarks/fp8/loss_parity.py --merge: the record's runs of the other modes stay, each naming its commit; a
    record whose settings differ in a key both configs have is refused in one sentence."""
    import json
    monkeypatch.syspath_prepend(str(BENCHMARKS / "fp8"))
    import loss_parity

    env = {"commit": "aaaaaaa"}
    record = {"environment": env, "config": {"train.steps": 300, "moe.old_key": 1},
              "runs": [{"fp8": "off", "final_eval_loss": 5.0}, {"fp8": "blockwise", "final_eval_loss": 4.9},
                       {"fp8": "rowwise", "final_eval_loss": 5.1, "environment": {"commit": "bbbbbbb"}}]}
    path = tmp_path / "parity.json"
    path.write_text(json.dumps(record))
    kept = loss_parity.kept_runs(str(path), {"train.steps": 300, "moe.new_key": 2}, ["rowwise"])
    assert [r["fp8"] for r in kept] == ["off", "blockwise"] and all(r["environment"] == env for r in kept)
    assert [r["environment"] for r in loss_parity.kept_runs(str(path), {"train.steps": 300}, ["off"])] == [
        env, {"commit": "bbbbbbb"}]
    with pytest.raises(SystemExit, match="another configuration \\(train.steps\\)"):
        loss_parity.kept_runs(str(path), {"train.steps": 100}, ["rowwise"])
    assert [r["fp8"] for r in loss_parity.kept_runs(str(path), {}, ["blockwise:bfloat16"])] == [
        "off", "blockwise", "rowwise"]  # a mode with its weight gradient's dtype is a mode of its own
    assert loss_parity.mode_settings("blockwise:bfloat16") == {"train.fp8": "blockwise",
                                                               "train.fp8_wgrad_dtype": "bfloat16"}
    assert loss_parity.mode_settings("off") == {"train.fp8": "off"}


def test_router_variants_are_changes_to_deepseek_v3s_router_settings():
    """benchmarks/router_balance.py: `defaults` is the preset as it is; every other variant starts from DeepSeek-V3's
    router settings, whatever the preset's own are, so a variant's name means one setting on every preset."""
    import sys

    from dropless.core.config import load_preset

    sys.path.insert(0, str(BENCHMARKS))
    import router_balance

    proxy = load_preset("deepseek-v3-proxy")
    assert proxy.moe.router_common_rate == 0.3 and proxy.moe.bias_update_rate == 0.01
    assert router_balance.variant_overrides("defaults", proxy) == {}
    dsv3 = proxy.replace(**router_balance.variant_overrides("deepseek-v3", proxy)).moe
    assert (dsv3.bias_update_rate, dsv3.router_common_rate, dsv3.router_common_source) == (0.001, 0.0, "running")
    common = proxy.replace(**router_balance.variant_overrides("common-0.3", proxy)).moe
    assert (common.bias_update_rate, common.router_common_rate, common.router_common_source) == (0.001, 0.3, "running")
    # The variants that the proxy and tiny presets adopted are the presets themselves.
    adopted = proxy.replace(**router_balance.variant_overrides("other-0.3-bias-1e-2", proxy))
    assert adopted.moe == proxy.moe
    tiny = load_preset("tiny")
    assert tiny.replace(**router_balance.variant_overrides("common-0.3-bias-3e-2-proportional", tiny)).moe == tiny.moe
    for name in router_balance.VARIANTS:  # each variant's overrides are valid config keys
        proxy.replace(**router_balance.variant_overrides(name, proxy))


def test_stage_profile_splits_the_stage_into_grouped_gemms_and_the_rest(tmp_path, monkeypatch):
    """benchmarks/stage_profile.py on the CPU's tiny stage: the forward and forward+backward programs traced, the
    grouped GEMMs' scopes counted apart from the permutation and combine, whose instructions are listed by name."""
    import json
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import stage_profile

    out = tmp_path / "profile.json"
    monkeypatch.setattr(sys, "argv", ["stage_profile", "--stages", "tiny", "--calls", "2", "--out", str(out)])
    stage_profile.main()
    record = json.loads(out.read_text())["stages"]["tiny"]
    for program in ("fwd", "fwdbwd"):
        r = record[program]
        assert r["grouped_gemm_ms"] > 0 and r["outside_gemms_ms"] > 0
        assert abs(r["grouped_gemm_ms"] + r["outside_gemms_ms"] - r["kernel_ms"]) < 1e-9
        names = " ".join(op["op_name"] for op in r["top_ops"] if op["category"] != "grouped_gemm")
        assert "permute" in names and "unpermute" in names
