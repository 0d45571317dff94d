"""The profile breakdown: HLO text parsing, trace reading, and the category split of a real CPU trace."""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dropless.bench import profile

HLO = """HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%async_computation (a: bf16[8,16]) -> bf16[8,16] {
  %a = bf16[8,16]{1,0} parameter(0)
  ROOT %all-to-all.1 = bf16[8,16]{1,0} all-to-all(%a), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (x: bf16[64,32], w: bf16[32,16]) -> bf16[64,16] {
  %x = bf16[64,32]{1,0} parameter(0), metadata={op_name="x"}
  %w = bf16[32,16]{1,0} parameter(1), metadata={op_name="w"}
  %gemm_fusion = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(train_step)/jvp(moe_layers)/while/body/moe/gmm_up/ragged_dot"}
  %cublas-gemm.3 = (bf16[2,64,64]{2,1,0}, s8[4194304]{0}) custom-call(%x, %x), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/transpose(jvp(attention))/bsd,btd->bst/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"lhs_batch_dimensions":["0"]}}}
  %cublas-gemm.4 = (bf16[64,16]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(train_step)/jvp(attention)/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[]}}}
  %loop_fusion.7 = bf16[64,16]{1,0} fusion(%gemm_fusion), kind=kLoop, calls=%fused_dot, metadata={op_name="jit(train_step)/jvp(dense_layers)/mlp/dot_general"}
  %exp.2 = bf16[64,16]{1,0} exponential(%gemm_fusion), metadata={op_name="jit(train_step)/jvp(attention)/exp"}
  %add.9 = bf16[64,16]{1,0} add(%gemm_fusion, %gemm_fusion), metadata={op_name="jit(train_step)/adamw/add"}
  %all-to-all-start = ((bf16[8,16]{1,0}), bf16[8,16]{1,0}) async-start(%x), calls=%async_computation, metadata={op_name="jit(train_step)/moe/dispatch/all_to_all"}
  ROOT %all-reduce-start.1 = bf16[64,16]{1,0} all-reduce-start(%add.9), replica_groups={{0,1}}, to_apply=%fused_dot
}
"""


def test_parse_hlo_resolves_fusions_custom_calls_and_async_collectives():
    ops = profile.parse_hlo(HLO)
    assert profile.hlo_module_name(HLO) == "jit_train_step"
    assert ops["gemm_fusion"].is_matmul and not ops["gemm_fusion"].batched
    assert ops["gemm_fusion"].op_name.endswith("gmm_up/ragged_dot")
    assert ops["cublas-gemm.3"].is_matmul and ops["cublas-gemm.3"].batched
    assert ops["cublas-gemm.4"].is_matmul and not ops["cublas-gemm.4"].batched
    assert not ops["exp.2"].is_matmul and ops["exp.2"].collective is None
    assert ops["all-to-all-start"].collective == "all-to-all"
    assert ops["all-reduce-start.1"].collective == "all-reduce"


def _event(hlo_op: str, name: str = "kernel", duration: float = 10.0) -> profile.KernelEvent:
    return profile.KernelEvent(name, duration, hlo_op, "jit_train_step", "/device:GPU:0")


@pytest.mark.parametrize("hlo_op, category", [
    ("gemm_fusion", "grouped_gemm"),          # inside gmm_up
    ("cublas-gemm.3", "attention"),           # batched matmul in the attention scope: scores
    ("cublas-gemm.4", "other_matmul"),        # x @ weight in the attention scope: a projection
    ("loop_fusion.7", "other_matmul"),        # dense MLP
    ("exp.2", "attention"),                   # softmax
    ("add.9", "other"),                       # optimizer
    ("all-to-all-start", "communication"),
])
def test_classify_by_hlo_instruction(hlo_op, category):
    assert profile.classify(_event(hlo_op), profile.parse_hlo(HLO))[0] == category


@pytest.mark.parametrize("name, category, kind", [
    ("ncclDevKernel_AllGather_RING_LL_Sum_bf16", "communication", "all-gather"),
    ("ncclDevKernel_SendRecv", "communication", "collective-permute"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "other_matmul", None),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "other_matmul", None),
    ("mosaic_gpu_ragged_dot_kernel", "grouped_gemm", None),
    ("cudnn_flash_fmha_fprop", "attention", None),
    ("Memcpy DtoH (Device -> Pinned)", "other", None),
])
def test_classify_by_kernel_name_when_the_instruction_is_unknown(name, category, kind):
    assert profile.classify(_event("", name), {}) == (category, kind, False)


def _write_trace(path, events):
    metadata = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(compute)"}},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    with gzip.open(path, "wt") as stream:
        json.dump({"traceEvents": metadata + events}, stream)


def test_read_trace_keeps_stream_kernels_only_and_breakdown_shares(tmp_path):
    def kernel(tid, hlo_op, dur, name="k", module="jit_train_step", pid=1):
        args = {"hlo_op": hlo_op, "hlo_module": module} if hlo_op else {}
        return {"ph": "X", "pid": pid, "tid": tid, "ts": 0, "dur": dur, "name": name, "args": args}

    _write_trace(tmp_path / "host.trace.json.gz", [
        kernel(7, "gemm_fusion", 60.0),
        kernel(8, "gemm_fusion", 60.0),                      # the derived "XLA Ops" line repeats it: ignored
        kernel(7, "all-to-all-start", 20.0),
        kernel(7, "", 10.0, name="Memcpy HtoD (Pinned -> Device)"),
        kernel(7, "add.9", 10.0),
        kernel(7, "fusion.1", 500.0, module="jit_init"),     # another program: filtered out
        kernel(3, "gemm_fusion", 99.0, pid=2),                # a host thread: not device time
    ])
    events = profile.read_trace(profile.find_trace(tmp_path))
    assert len(events) == 5
    result = profile.breakdown(events, profile.parse_hlo(HLO), module="jit_train_step", steps=2)
    assert result["kernel_ms_per_step_per_device"] == pytest.approx(0.05)
    assert result["share"]["grouped_gemm"] == pytest.approx(0.6)
    assert result["communication_share"] == pytest.approx(0.2)
    assert result["communication_ms_per_step_per_device"]["all-to-all"] == pytest.approx(0.01)
    assert result["share"]["other"] == pytest.approx(0.2)
    assert result["unattributed_share"] == pytest.approx(0.1)
    assert sum(result["share"].values()) == pytest.approx(1.0)
    assert result["top_ops"][0]["op"] == "gemm_fusion"
    assert "communication share 20.0%" in profile.format_breakdown(result)


def test_collective_waiting_is_what_a_device_ran_beyond_the_shortest_kernel_of_each_instance():
    """A device that reaches a collective first runs its kernel longer (it waits for the other): per instance the
    shortest kernel is the collective, the rest of the others' is waiting. Compute kernels never count."""
    ops = profile.parse_hlo(HLO)

    def kernel(device, hlo_op, start, duration):
        return profile.KernelEvent("k", duration, hlo_op, "jit_train_step", device, start)

    gpu0, gpu1, exchange = "/device:GPU:0", "/device:GPU:1", "all-to-all-start"
    events = [kernel(gpu0, exchange, 0, 300.0), kernel(gpu1, exchange, 0, 100.0),
              kernel(gpu0, exchange, 50, 200.0), kernel(gpu1, exchange, 50, 250.0),
              kernel(gpu0, "gemm_fusion", 10, 900.0), kernel(gpu1, "gemm_fusion", 10, 10.0)]
    assert profile.collective_waiting_us(events, ops) == pytest.approx(200.0 + 50.0)
    # instances are matched by order: a collective seen a different number of times per device is left out
    assert profile.collective_waiting_us(events[:3], ops) == 0.0
    result = profile.breakdown(events, ops, steps=1)
    assert result["communication_waiting_ms_per_step_per_device"] == pytest.approx(0.125)  # 250 us over 2 devices
    assert "of which waiting for another device 0.12 ms" in profile.format_breakdown(result)


def test_find_trace_explains_a_missing_trace(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        profile.find_trace(tmp_path)


def test_breakdown_of_a_real_cpu_trace(tmp_path):
    """A jitted function with the model's scope names and real collectives, traced on two CPU devices."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])

    def per_device(x_TD, w_DD, w_GDD):
        with jax.named_scope("attention"):
            # Two heads: the score and value matmuls are batched, as attention's are; the projection is not. The
            # barrier keeps the projection out of the core's fusion (XLA:CPU fuses a matmul chain into one
            # kernel, named by its last matmul).
            x_HTE = x_TD.reshape(x_TD.shape[0], 2, -1).transpose(1, 0, 2)
            scores_HTT = jnp.einsum("hte,hse->hts", x_HTE, x_HTE)
            core_HTE = jnp.einsum("hts,hse->hte", jax.nn.softmax(scores_HTT), x_HTE)
            h_TD = jax.lax.optimization_barrier(core_HTE.transpose(1, 0, 2).reshape(x_TD.shape)) @ w_DD
        with jax.named_scope("gmm_up"):
            y_TD = jax.lax.ragged_dot(h_TD, w_GDD, jnp.array([100, 156], jnp.int32))
        return jax.lax.psum(jnp.tanh(y_TD), "x")

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x")))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (512, 128)), NamedSharding(mesh, P("x")))
    w, w3 = jnp.ones((128, 128)) / 128, jnp.ones((2, 128, 128)) / 128
    compiled = fn.lower(x, w, w3).compile()
    compiled(x, w, w3).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            out = compiled(x, w, w3)
        out.block_until_ready()
    hlo = compiled.as_text()
    result = profile.breakdown(profile.read_trace(profile.find_trace(tmp_path)), profile.parse_hlo(hlo),
                               module=profile.hlo_module_name(hlo), steps=2)
    assert result["devices"] == 2
    for category in ("grouped_gemm", "attention", "other_matmul", "communication"):
        assert result["ms_per_step_per_device"][category] > 0, category
    assert result["communication_ms_per_step_per_device"]["all-reduce"] > 0
    assert result["unattributed_share"] == 0.0
    assert sum(result["share"].values()) == pytest.approx(1.0)
    exposed = result["communication_exposed_ms_per_step_per_device"]
    assert 0 <= exposed <= result["ms_per_step_per_device"]["communication"] * (1 + 1e-9)  # rounding only
    grouped = [op for op in result["top_ops"] if op["category"] == "grouped_gemm"]
    assert grouped and all("gmm_up" in op["op_name"] for op in grouped)
    np.testing.assert_allclose(sum(result["ms_per_step_per_device"].values()), result["kernel_ms_per_step_per_device"])


def _timeline(device, *spans):
    """Kernel events of one device: (hlo_op, start, end) each, on whatever stream."""
    return [profile.KernelEvent("k", end - start, hlo_op, "jit_train_step", device, start) for hlo_op, start, end in spans]


@pytest.mark.parametrize("spans, exposed", [
    ([("all-to-all-start", 10, 20), ("gemm_fusion", 0, 30)], 0.0),            # fully hidden
    ([("all-to-all-start", 10, 40), ("gemm_fusion", 0, 30)], 10.0),           # partly hidden (its tail)
    ([("all-to-all-start", 0, 40), ("gemm_fusion", 10, 15), ("add.9", 20, 25)], 30.0),  # holes between kernels
    ([("all-to-all-start", 50, 60), ("gemm_fusion", 0, 30)], 10.0),           # not hidden
    # several streams: two overlapping collectives count once; kernels of two streams cover jointly
    ([("all-to-all-start", 0, 20), ("all-reduce-start.1", 10, 30), ("gemm_fusion", 5, 12), ("exp.2", 12, 25)], 10.0),
])
def test_exposed_communication_is_collective_time_with_no_other_kernel_running(spans, exposed):
    ops = profile.parse_hlo(HLO)
    assert profile.exposed_communication_us(_timeline("/device:GPU:0", *spans), ops) == pytest.approx(exposed)


def test_exposed_communication_is_per_device_and_matches_a_unit_grid_count():
    """Another device's compute hides nothing; on random timelines the interval arithmetic equals counting unit
    cells of an integer grid (the simple reference)."""
    ops = profile.parse_hlo(HLO)
    gpu0 = _timeline("/device:GPU:0", ("all-to-all-start", 0, 10))
    gpu1 = _timeline("/device:GPU:1", ("gemm_fusion", 0, 10), ("all-to-all-start", 0, 10))
    assert profile.exposed_communication_us(gpu0 + gpu1, ops) == pytest.approx(10.0)
    rng = np.random.default_rng(0)
    for _ in range(50):
        spans = [(("all-to-all-start", "all-reduce-start.1", "gemm_fusion", "add.9", "exp.2")[rng.integers(5)],
                  start, start + rng.integers(1, 15)) for start in rng.integers(0, 60, rng.integers(1, 12))]
        busy, talking = np.zeros(80, bool), np.zeros(80, bool)
        for hlo_op, start, end in spans:
            (talking if hlo_op in ("all-to-all-start", "all-reduce-start.1") else busy)[start:end] = True
        want = float(np.sum(talking & ~busy))
        assert profile.exposed_communication_us(_timeline("/device:GPU:0", *spans), ops) == pytest.approx(want)


def test_breakdown_reports_exposed_communication_beside_the_total():
    ops = profile.parse_hlo(HLO)
    events = (_timeline("/device:GPU:0", ("all-to-all-start", 0, 40), ("gemm_fusion", 0, 30))
              + _timeline("/device:GPU:1", ("all-to-all-start", 0, 40), ("gemm_fusion", 20, 60)))
    result = profile.breakdown(events, ops, steps=2)
    # 10 us exposed on GPU:0 and 20 on GPU:1: 30 us over 2 devices and 2 steps
    assert result["communication_exposed_ms_per_step_per_device"] == pytest.approx(0.0075)
    assert result["ms_per_step_per_device"]["communication"] == pytest.approx(0.02)
    assert result["communication_exposed_share"] == pytest.approx(30.0 / 150.0)
    assert "exposed communication 0.01 ms   20.0% (not overlapped with any other kernel; 0.01 ms hidden" in (
        profile.format_breakdown(result))
