"""tokamax's Mosaic GPU flash attention at DeepSeek-V3's MLA shape on one GPU: the forward and the backward with
its heuristic configuration and with each configuration of tokamax's own autotuning space, the gradients checked
against the heuristic's, beside cuDNN's fused flash attention (`model.attention_backend=cudnn`, its output and
gradients checked against tokamax's and against a float32 einsum on the first sequence) and the bf16 dense
matmul rate of the same call.

    python benchmarks/attention_vjp_configs.py --out attention-vjp-h200.json [--batch 2 --seq 4096]

FLOPs (causal, half the square): forward 2 * B * H * S^2 / 2 * (Dqk + Dv); backward 2.5 times that (dQ, dK, dV and
the recomputed logits: five matmuls against the forward's two).
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp

from dropless.bench.harness import time_calls
from dropless.bench.records import environment, write_json


def rel_err(got, want) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def vjp_program(attend, cotangent):
    """(q, k, v) -> (attend's output, dq, dk, dv) for `cotangent`, one jitted program."""
    def f(q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, *pullback(cotangent)
    return jax.jit(f)


def cudnn_records(q, k, v, do, scale, tokamax_out_grads, fwd_flops) -> list[dict]:
    """cuDNN's forward and forward+backward through dropless's binding call, each checked first: against tokamax's
    output and gradients (both bf16 flash attention), and, with tokamax's, against the float32 einsum on the first
    sequence (the reference both must approach)."""
    from dropless.models.attention import causal_attention, cudnn_attention

    records = []
    try:
        cudnn = vjp_program(lambda q, k, v: cudnn_attention(q, k, v, scale), do)
        got = cudnn(q, k, v)
        f32 = lambda t: t[:1].astype(jnp.float32)
        exact = vjp_program(lambda q, k, v: causal_attention(q[:, :, :, None], k, v, scale)[:, :, :, 0], f32(do))(
            f32(q), f32(k), f32(v))  # one kv head per query head: G = 1
        names = ("out", "dq", "dk", "dv")
        errors = {"vs_tokamax": {n: rel_err(g, w) for n, g, w in zip(names, got, tokamax_out_grads)},
                  "vs_float32_first_sequence": {n: rel_err(g[:1], e) for n, g, e in zip(names, got, exact)},
                  "tokamax_vs_float32_first_sequence": {n: rel_err(w[:1], e) for n, w, e in
                                                        zip(names, tokamax_out_grads, exact)}}
        del exact
        fwd = jax.jit(lambda q, k, v: cudnn_attention(q, k, v, scale))
        t_fwd = time_calls(fwd, [(q, k, v)])
        records.append({"variant": "forward (cudnn)", "ms": 1e3 * t_fwd, "tflops": fwd_flops / t_fwd / 1e12})
        t = time_calls(cudnn, [(q, k, v)])
        records.append({"variant": "forward+backward (cudnn)", "ms": 1e3 * t, "backward_ms": 1e3 * (t - t_fwd),
                        "backward_tflops": 2.5 * fwd_flops / (t - t_fwd) / 1e12, "errors": errors})
    except Exception as e:  # noqa: BLE001 - a backend that fails at this shape is a result
        records.append({"variant": "cudnn", "error": str(e).split("\n")[0][:300]})
    for rec in records:
        print(json.dumps(rec), flush=True)
    return records


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--qk-dim", type=int, default=192)
    p.add_argument("--v-dim", type=int, default=128)
    a = p.parse_args()
    import tokamax
    from tokamax._src.ops.attention import pallas_mosaic_gpu as mgpu
    from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp as mgpu_vjp

    b, s, h, dq, dv = a.batch, a.seq, a.heads, a.qk_dim, a.v_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, dq), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, h, dq), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, h, dv), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, s, h, dv), jnp.bfloat16)
    fwd_flops = 2.0 * b * h * s * s / 2 * (dq + dv)
    scale = dq ** -0.5

    def grads(impl):
        return vjp_program(lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation=(impl,)), do)

    records = []
    x = jax.random.normal(jax.random.key(5), (8192, 8192), jnp.bfloat16)
    t = time_calls(jax.jit(lambda x: x @ x), [(x,)])
    records.append({"variant": "bf16 dense matmul 8192^3", "ms": 1e3 * t, "tflops": 2 * 8192 ** 3 / t / 1e12})
    fwd = jax.jit(lambda q, k, v: tokamax.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                               implementation="mosaic"))
    t = time_calls(fwd, [(q, k, v)])
    records.append({"variant": "forward (mosaic, heuristic)", "ms": 1e3 * t, "tflops": fwd_flops / t / 1e12})
    fwd_ms = 1e3 * t
    baseline = grads("mosaic")
    want = baseline(q, k, v)
    t = time_calls(baseline, [(q, k, v)])
    records.append({"variant": "forward+backward (mosaic, heuristic)", "ms": 1e3 * t,
                    "backward_ms": 1e3 * t - fwd_ms, "backward_tflops": 2.5 * fwd_flops / (t - fwd_ms / 1e3) / 1e12})
    print(json.dumps(records[-3]), json.dumps(records[-2]), json.dumps(records[-1]), sep="\n", flush=True)
    records += cudnn_records(q, k, v, do, scale, want, fwd_flops)
    for block_q, block_kv, stages, wgs in itertools.product((64, 128), (64, 128), (2,), (1, 2)):
        config = mgpu_vjp.Config(block_q_dkv=block_q, block_kv_dkv=block_kv, block_q_dq=block_q,
                                 block_kv_dq=block_kv, num_stages=stages, compute_wgs=wgs)
        rec = {"variant": f"forward+backward, vjp blocks q {block_q} kv {block_kv}, {stages} stages, {wgs} wgs"}
        try:
            fn = grads(mgpu.PallasMosaicGpuFlashAttention(vjp=mgpu_vjp.PallasMosaicGpuFlashAttentionVjp(config=config)))
            got = fn(q, k, v)
            rec["max_rel_err_vs_heuristic"] = max(
                float(jnp.linalg.norm((g - w).astype(jnp.float32)) / jnp.linalg.norm(w.astype(jnp.float32)))
                for g, w in zip(got[1:], want[1:]))
            t = time_calls(fn, [(q, k, v)])
            rec |= {"ms": 1e3 * t, "backward_ms": 1e3 * t - fwd_ms,
                    "backward_tflops": 2.5 * fwd_flops / (t - fwd_ms / 1e3) / 1e12}
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a result
            rec["error"] = str(e).split("\n")[0][:300]
        print(json.dumps(rec), flush=True)
        records.append(rec)
        write_json(a.out, {"benchmark": "attention-vjp", "environment": environment(),
                           "shape": {"batch": b, "seq": s, "heads": h, "qk_dim": dq, "v_dim": dv}, "records": records})


if __name__ == "__main__":
    main()
