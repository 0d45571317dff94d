"""`dropless.plan.cost`: the step's FLOPs by kind and remat mode against the matmuls of the real training step
(its jaxpr, and the program XLA compiles from it), and the time terms that follow from them."""

from __future__ import annotations

import collections
import json
import math
import re

import jax
import pytest
from jax.extend import core as jex_core

from dropless.bench import harness
from dropless.core.config import load_preset
from dropless.models.flops import model_flops_per_token
from dropless.plan import Cluster, make_plan
from dropless.plan.cost import (ACTIVATION_PASSES, RECOMPUTED_PASSES, SCAN_PASSES, device_rates, gmm_rate,
                                 load_rates, step_flops, step_time)
from dropless.plan.layout import model_facts
from dropless.plan.memory import blocks
from tests.micro_config import micro_config

REMAT = ("none", "moe", "full")
SMALL_GQA = {"model.num_layers": 2, "model.hidden_size": 64, "model.vocab_size": 128, "model.num_heads": 4,
             "model.num_kv_heads": 2, "model.head_dim": 16, "moe.num_experts": 8, "moe.expert_intermediate_size": 32,
             "train.batch_size": 2, "train.seq_len": 16, "moe.gmm_backend": "xla"}
# One small model of each family: MLA with a dense layer and a shared expert (the DeepSeek-V3 shape), the same
# with one MTP module (its own MoE block, input projection and pass through the output head), and GQA with q/k
# norms, 8 experts of which the router picks 8 (Qwen3) or 2 (Mixtral); scanned and unrolled layers. (The MTP
# modules run unrolled either way, so their jaxpr's matmuls do not depend on `train.scan_layers`.) The micro
# config, from `tiny`, folds the routers' running input means into their kernels; one DeepSeek-V3 model takes each
# sequence's direction from the other sequences instead (moe.router_common_source).
FAMILIES = {
    "deepseek_v3": lambda **o: micro_config(**{"train.scan_layers": False, **o}),
    "deepseek_v3_other_sequences": lambda **o: micro_config(**{"moe.router_common_source": "other_sequences", **o}),
    "deepseek_v3_mtp": lambda **o: micro_config(**{"model.mtp_layers": 1, **o}),
    "qwen3_moe": lambda **o: load_preset("qwen3-30b-a3b").replace(**{**SMALL_GQA, **o}),
    "mixtral": lambda **o: load_preset("mixtral-8x7b").replace(**{**SMALL_GQA, "train.scan_layers": False, **o}),
}


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def matmul_flops(jaxpr, counts=None, times: int = 1) -> collections.Counter:
    """FLOPs and counts of the dense (`dot_general`) and grouped (`ragged_dot_general`) matmuls a jaxpr runs, with
    every scan body counted once per iteration. A grouped matmul does each row's product once: its output holds
    a group axis only when the ragged rows are contracted (the weight gradient), and that axis is no extra work."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "ragged_dot_general"):
            lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
            numbers = eqn.params["dimension_numbers"] if name == "dot_general" else \
                eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
            contracted = math.prod(lhs.shape[d] for d in numbers[0][0])
            flops = 2 * math.prod(out.shape) * contracted
            if name == "ragged_dot_general":
                groups = eqn.invars[2].aval.shape[-1]
                ragged = eqn.params["ragged_dot_dimension_numbers"].lhs_ragged_dimensions
                flops //= groups if set(ragged) & set(numbers[0][0]) else 1
            kind = "dense" if name == "dot_general" else "grouped"
            counts[kind] += times * flops
            counts[f"{kind}_ops"] += times
        for sub in _sub_jaxprs(eqn):
            matmul_flops(sub, counts, times * (eqn.params["length"] if name == "scan" else 1))
    return counts


def norm_flops(config) -> int:
    """6 FLOPs per token for each norm weight: the plan's dense FLOPs count them as matmul parameters
    (`dropless.models.flops`: a negligible 2 * D per layer at real widths, a percent at these)."""
    tokens = config.train.batch_size * config.train.seq_len
    return 6 * tokens * sum(math.prod(spec.shape) for name, spec in model_facts(config)[0] if name[-1].endswith("norm"))


def step_matmuls(config) -> collections.Counter:
    setup = harness.build(config, jax.devices()[:1])
    return matmul_flops(jax.make_jaxpr(setup.step)(*harness.abstract_args(setup)).jaxpr)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(family, {remat: (config, the training step's matmul FLOPs)})."""
    build = FAMILIES[request.param]
    return request.param, {remat: (cfg := build(**{"train.remat": remat}), step_matmuls(cfg)) for remat in REMAT}


def test_the_plans_flops_are_the_training_steps_matmuls(family):
    """Per remat mode, the plan's grouped FLOPs (+ their recomputation) are exactly the step's grouped matmuls,
    and its dense + attention FLOPs the step's dense matmuls; XLA's attention einsum computes the masked half of
    the causal scores too, so the step runs twice the plan's (causal) attention FLOPs. The plan's only excess is
    its norm weights (6 FLOPs per token each, a third of that again when recomputed). Its model FLOPs are
    `dropless.models.flops`'."""
    name, runs = family
    for remat, (config, counted) in runs.items():
        f = step_flops(config)
        tokens = config.train.batch_size * config.train.seq_len
        assert f["model"] == tokens * model_flops_per_token(config, config.train.seq_len), (name, remat)
        assert counted["grouped"] == f["grouped"] + f["recompute_grouped"], (name, remat)
        dense = f["dense"] + f["recompute_dense"] + 2 * (f["attention"] + f["recompute_attention"])
        assert 0 <= dense - counted["dense"] <= norm_flops(config) * 4 / 3, (name, remat, counted["dense"], dense)


@pytest.mark.parametrize("overrides", [
    {}, {"moe.router_common_source": "other_sequences"}, {"train.grad_accum_steps": 2, "model.mtp_layers": 1},
    {"moe.router_common_source": "other_sequences", "train.grad_accum_steps": 2, "train.remat": "moe"},
    {"train.batch_size": 1, "moe.router_common_source": "other_sequences", "train.remat": "full"},
])
def test_the_router_common_flops_are_what_the_option_adds_to_the_step(overrides):
    """`router_common_flops` exactly: the step's matmul FLOPs with moe.router_common_rate on, less those with it
    off, are the plan's dense FLOPs' difference (running mean or other sequences, microbatches, MTP rows, remat;
    one sequence per microbatch falls back to the running mean)."""
    on = micro_config(**{"moe.router_common_rate": 0.3, **overrides})
    off = on.replace(**{"moe.router_common_rate": 0.0, "moe.router_common_source": "running"})
    added = step_matmuls(on)["dense"] - step_matmuls(off)["dense"]
    planned = {c: step_flops(c) for c in (on, off)}
    assert added > 0
    assert added == sum(planned[on][k] - planned[off][k] for k in ("dense", "recompute_dense"))


def test_the_recomputed_forward_is_what_each_remat_mode_adds(family):
    """What remat adds over `none`, by kind: under `moe` the MoE blocks' grouped GEMMs, router and shared experts'
    gate and up projections, under `full` every block's matmuls but the down projections whose output only joins
    the residual stream (the output head and the MTP input projections are outside the blocks); one recomputed
    forward, no more."""
    name, runs = family
    none = runs["none"][1]
    for remat in ("moe", "full"):
        config, counted = runs[remat]
        f = step_flops(config)
        assert counted["grouped"] - none["grouped"] == f["recompute_grouped"] > 0, (name, remat)
        added = counted["dense"] - none["dense"]
        expected = f["recompute_dense"] + 2 * f["recompute_attention"]
        assert 0 <= expected - added <= norm_flops(config) / 3, (name, remat, added, expected)
        assert f["recompute"] == f["recompute_dense"] + f["recompute_grouped"] + f["recompute_attention"]
    # Under `moe` the forward of each MoE block's grouped GEMMs runs again (gate+up, down: 2 per MoE layer and
    # MTP MoE block)
    moe_blocks = blocks(runs["none"][0].model)[1]
    assert runs["moe"][1]["grouped_ops"] - none["grouped_ops"] == 2 * moe_blocks
    assert runs["full"][1]["grouped_ops"] == runs["moe"][1]["grouped_ops"]


def test_xla_compiles_one_recomputation_per_remat_mode():
    """The compiled program (XLA:CPU, layers unrolled, so each layer's dots are in its text) keeps exactly the
    matmuls the jaxpr asks for: the recomputed forward is neither merged away nor run twice. (On the CPU a grouped
    matmul compiles to dots.)"""
    for remat in REMAT:
        config = FAMILIES["qwen3_moe"](**{"train.remat": remat, "train.scan_layers": False})
        setup = harness.build(config, jax.devices()[:1])
        traced = setup.step.trace(*harness.abstract_args(setup))  # one trace: its jaxpr counted, its program compiled
        counted = matmul_flops(traced.jaxpr.jaxpr)
        text = traced.lower().compile().as_text()
        assert len(re.findall(r" dot\(", text)) == counted["dense_ops"] + counted["grouped_ops"], remat


def test_compute_time_is_each_kinds_flops_at_its_own_rate():
    """The compute term charges the recomputed grouped GEMMs at the grouped-GEMM rate and the recomputed
    attention at the attention rate, whatever the share of the output head in the dense FLOPs."""
    rates = device_rates(load_rates(), "H200")
    for remat in REMAT:
        config = load_preset("qwen3-30b-a3b").replace(**{"model.num_layers": 4, "train.batch_size": 4,
                                                         "train.remat": remat})
        plan = make_plan(config, Cluster(1, 1, "H200"))
        f = plan.time["flops"]
        expected = ((f["dense"] + f["recompute_dense"]) / rates["dense_tflops"]
                    + (f["grouped"] + f["recompute_grouped"]) / gmm_rate(rates, 4 * 4096 * 8 / 128)
                    + (f["attention"] + f["recompute_attention"]) / rates["attention_tflops"]) / 1e12
        assert plan.time["terms_s"]["compute"] == pytest.approx(expected, rel=1e-9), remat


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_mtp"])
def test_fp8_runs_every_matmul_but_the_output_head_at_its_recipes_speed_up(family):
    """Under train.fp8 the grouped GEMMs and the dense matmuls run at the recipe's measured speed-up, the output
    head (once per MTP module too) at bf16's rate; "off" and a table without the recipe are the bf16 plan."""
    rates = device_rates(load_rates(), "H200")
    speedup = rates["fp8_speedup"]["blockwise"]
    assert speedup["grouped"] > 1 and speedup["dense"] > 1
    for remat in REMAT:
        config = FAMILIES[family](**{"train.remat": remat, "train.fp8": "blockwise"})
        f = step_flops(config)
        m = config.model
        assert f["head"] == config.train.batch_size * config.train.seq_len * 6 * (1 + m.mtp_layers) \
            * m.hidden_size * m.vocab_size
        assert 0 < f["head"] < f["dense"]
        plan = make_plan(config, Cluster(1, 1, "H200"))
        expected = (f["head"] / rates["dense_tflops"]
                    + (f["dense"] - f["head"] + f["recompute_dense"]) / (rates["dense_tflops"] * speedup["dense"])
                    + (f["grouped"] + f["recompute_grouped"])
                    / (plan.time["grouped_gemm"]["tflops"])
                    + (f["attention"] + f["recompute_attention"]) / rates["attention_tflops"]) / 1e12
        assert plan.time["terms_s"]["compute"] == pytest.approx(expected, rel=1e-9), remat
        bf16 = make_plan(config.replace(**{"train.fp8": "off"}), Cluster(1, 1, "H200"))
        assert bf16.time["terms_s"]["compute"] > plan.time["terms_s"]["compute"]
        without = {k: v for k, v in rates.items() if k != "fp8_speedup"}
        assert step_time(config, plan.mesh, Cluster(1, 1, "H200"), plan.memory, without)["terms_s"]["compute"] \
            == pytest.approx(bf16.time["terms_s"]["compute"], rel=1e-9)


def test_remat_moves_activation_traffic_into_the_recomputation():
    """What remat does not keep is still written and read (once more, by the recomputation): kept +
    recomputed is the whole of what the layers save without remat, and the memory-bound term grows."""
    none = make_plan(FAMILIES["deepseek_v3"](), Cluster(1, 1, "H200"))
    for remat in ("moe", "full"):
        plan = make_plan(FAMILIES["deepseek_v3"](**{"train.remat": remat}), Cluster(1, 1, "H200"))
        m = plan.memory
        assert m.activations < none.memory.activations
        assert m.activations + m.recomputed_activations == none.memory.activations, remat
        assert plan.time["terms_s"]["memory_bound"] > none.time["terms_s"]["memory_bound"], remat
    assert none.memory.recomputed_activations == 0 and RECOMPUTED_PASSES == ACTIVATION_PASSES + 1


def test_the_scan_costs_passes_over_what_it_stacks():
    """Under train.scan_layers the step pays SCAN_PASSES over the stacked residuals (one microbatch's, per
    microbatch) and the stacked weights' float32 gradients; unrolled it pays nothing. Remat stacks less, so its
    scan term is smaller: under `full` only each layer's input [T, D] and the gradients remain."""
    rates = device_rates(load_rates(), "H200")
    qwen = load_preset("qwen3-30b-a3b").replace(**{"model.num_layers": 4, "train.batch_size": 4})
    terms = {}
    for remat in REMAT:
        for micro in (1, 2):
            config = qwen.replace(**{"train.remat": remat, "train.grad_accum_steps": micro})
            plan = make_plan(config, Cluster(1, 1, "H200"))
            m = plan.memory
            expected = SCAN_PASSES * m.stacked_bytes * micro / (rates["hbm_gbps"] * 1e9)
            assert plan.time["terms_s"]["scan_buffers"] == pytest.approx(expected, rel=1e-12)
            terms[remat, micro] = m.stacked_bytes
        unrolled = make_plan(config.replace(**{"train.scan_layers": False}), Cluster(1, 1, "H200"))
        assert unrolled.memory.stacked_bytes == 0 and unrolled.time["terms_s"]["scan_buffers"] == 0
    assert terms["none", 1] > terms["moe", 1] > terms["full", 1]
    # Under `full`: each layer's input (bf16) and the float32 gradients of every stacked weight, exactly.
    tokens = qwen.train.batch_size * qwen.train.seq_len
    stacked_weights = sum(math.prod(spec.shape) for path, spec in model_facts(qwen)[0]
                          if path[0] in ("dense_layers", "moe_layers"))
    full = make_plan(qwen.replace(**{"train.remat": "full"}), Cluster(1, 1, "H200"))
    assert full.memory.stacked_bytes == pytest.approx(
        tokens * qwen.model.num_layers * qwen.model.hidden_size * 2 + 4 * stacked_weights, rel=1e-6)


def test_the_grouped_gemm_rate_follows_rows_per_local_expert():
    """The table's measured points exactly, log-linear between them, flat beyond; the step reads it at T*K rows
    per local expert (under expert parallelism each device's experts receive the T*K rows of the group's)."""
    rates = device_rates(load_rates(), "H200")
    points = sorted((p["rows"], p["value"]) for p in rates["gmm_tflops"]["by_rows_per_expert"])
    assert len(points) >= 3
    for rows, value in points:
        assert gmm_rate(rates, rows) == pytest.approx(value)
    (r0, v0), (r1, v1) = points[:2]
    middle = math.sqrt(r0 * r1)
    assert gmm_rate(rates, middle) == pytest.approx((v0 + v1) / 2)
    assert gmm_rate(rates, 1) == points[0][1] and gmm_rate(rates, 1 << 20) == points[-1][1]
    grid = [2 ** (i / 4) for i in range(4 * 4, 4 * 16)]
    assert all(gmm_rate(rates, a) <= gmm_rate(rates, b) for a, b in zip(grid, grid[1:]))
    proxy = load_preset("deepseek-v3-proxy")  # 32 experts, top-8
    for batch, devices, expert in ((1, 1, 1), (8, 1, 1), (8, 8, 8), (8, 8, 2)):
        config = proxy.replace(**{"train.batch_size": batch, "parallel.expert": expert})
        plan = make_plan(config, Cluster(1, devices, "H200"))
        rows = batch * 4096 // devices * 8 * expert / 32
        assert plan.time["grouped_gemm"]["rows_per_expert"] == pytest.approx(rows)
        assert plan.time["grouped_gemm"]["tflops"] == pytest.approx(gmm_rate(rates, rows))


def test_the_collectives_bytes_follow_the_mesh_and_the_step():
    """Each device sends per step: a ring all-reduce of the replicated float32 gradients (2 (n-1)/n of them), FSDP's
    compute-dtype gathers twice (forward, backward) for one reduce-scatter, per microbatch, and the MoE exchange,
    once more under remat, with float8 dispatch rows of one byte on the way out. Within a host when the group
    fits in it."""
    proxy = load_preset("deepseek-v3-proxy").replace(**{"train.batch_size": 16})

    def sent(overrides, cluster=Cluster(1, 8, "H200")):
        plan = make_plan(proxy.replace(**overrides), cluster)
        return plan, {c["name"]: (c["bytes_per_device"], c["within_host"]) for c in plan.time["collectives"]}

    plan, data = sent({"parallel.data": 8})
    assert set(data) == {"gradient_all_reduce"}
    assert data["gradient_all_reduce"][0] == pytest.approx(2 * 7 / 8 * plan.memory.gradients, rel=1e-9)
    _, fsdp = sent({"parallel.fsdp": 8})
    assert fsdp["fsdp_all_gather"][0] == pytest.approx(2 * fsdp["fsdp_reduce_scatter"][0], rel=1e-9)
    assert fsdp["fsdp_all_gather"][1] and fsdp["fsdp_reduce_scatter"][1]
    _, accumulated = sent({"parallel.fsdp": 8, "train.grad_accum_steps": 2})
    assert accumulated["fsdp_all_gather"][0] == pytest.approx(2 * fsdp["fsdp_all_gather"][0], rel=1e-9)
    _, across = sent({"parallel.fsdp": 8}, Cluster(2, 4, "H200"))
    assert not across["fsdp_all_gather"][1] and across["fsdp_all_gather"][0] == fsdp["fsdp_all_gather"][0]
    _, ep = sent({"parallel.expert": 8})
    _, remat = sent({"parallel.expert": 8, "train.remat": "moe"})
    _, fp8_wire = sent({"parallel.expert": 8, "moe.dispatch_dtype": "float8"})
    assert remat["moe_allgather"][0] == pytest.approx(3 / 2 * ep["moe_allgather"][0], rel=1e-9)
    assert fp8_wire["moe_allgather"][0] == pytest.approx((1 + 2) / (2 + 2) * ep["moe_allgather"][0], rel=1e-9)


def test_the_time_terms_charge_hidden_syncs_host_copies_and_update_traffic():
    """FSDP and gradient syncs cost only what the compute does not hide; an offloaded optimizer state crosses to
    the host and back each step, offloaded activations each microbatch; the update reads and writes the moments;
    microbatches move the whole batch's activations, as one batch would."""
    rates = device_rates(load_rates(), "H200")
    proxy = load_preset("deepseek-v3-proxy").replace(**{"train.batch_size": 16})
    for overrides in ({"parallel.data": 8}, {"parallel.expert": 8}):
        plan = make_plan(proxy.replace(**overrides), Cluster(1, 8, "H200"))
        syncs = sum(c["seconds"] for c in plan.time["collectives"] if not c["name"].startswith("moe_"))
        assert plan.time["terms_s"]["fsdp_and_gradient_sync_exposed"] == pytest.approx(
            max(0.0, syncs - plan.time["terms_s"]["compute"]), rel=1e-9)
    exposed = {axis: make_plan(proxy.replace(**{axis: 8}), Cluster(1, 8, "H200")).time["terms_s"][
        "fsdp_and_gradient_sync_exposed"] for axis in ("parallel.expert", "parallel.data")}
    assert exposed["parallel.expert"] == 0 < exposed["parallel.data"]
    host = rates["host_gbps"] * 1e9
    offloaded = make_plan(proxy.replace(**{"train.offload_optimizer": True}), Cluster(1, 8, "H200"))
    assert offloaded.time["terms_s"]["host_copies"] == pytest.approx(2 * offloaded.memory.optimizer_state / host)
    for micro in (1, 2):
        named = make_plan(proxy.replace(**{"train.remat": "full", "train.offload": "attn_out,moe_in",
                                           "train.grad_accum_steps": micro}), Cluster(1, 8, "H200"))
        assert named.time["terms_s"]["host_copies"] == pytest.approx(
            2 * named.memory.activations_in_host * micro / host)
    hbm = rates["hbm_gbps"] * 1e9
    one = make_plan(proxy, Cluster(1, 8, "H200"))
    half = make_plan(proxy.replace(**{"train.optimizer_moments_dtype": "bfloat16"}), Cluster(1, 8, "H200"))
    assert one.time["terms_s"]["memory_bound"] - half.time["terms_s"]["memory_bound"] == pytest.approx(
        2 * (one.memory.optimizer_state - half.memory.optimizer_state) / hbm)
    two = make_plan(proxy.replace(**{"train.grad_accum_steps": 2}), Cluster(1, 8, "H200"))
    assert two.time["terms_s"]["memory_bound"] - one.time["terms_s"]["memory_bound"] == pytest.approx(
        (two.memory.gradient_buffers - one.memory.gradient_buffers) / hbm)


def test_a_rate_table_may_have_no_step_overhead(tmp_path):
    """step_overhead_ms is the one rate that may be 0 (a device measured without fixed per-step cost); any other
    rate of 0 is refused."""
    table = load_rates()
    entry = table["H200"]
    entry["step_overhead_ms"] = {**entry["step_overhead_ms"], "value": 0}
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(table))
    assert device_rates(load_rates(path), "H200")["step_overhead_ms"] == 0
    entry["hbm_gbps"] = {**entry["hbm_gbps"], "value": 0}
    path.write_text(json.dumps(table))
    with pytest.raises(Exception, match="hbm_gbps"):
        load_rates(path)
