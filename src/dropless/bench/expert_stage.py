"""The whole routed-expert stage against its dense equivalent: `dropless bench gmm --stages NAME,...`.

The stage is what a MoE layer runs between the router and the combine, on one device: permute (sort the token
copies by expert) -> gate+up grouped GEMM -> SwiGLU -> down grouped GEMM -> unpermute (gather back and combine
each token's K rows with its routing weights), `dropless.moe.executor.LocalExecutor` exactly as the layer calls
it. Its dense equivalent is the two dense matmuls of equal FLOPs, [M, D] x [D, 2F] and [M, F] x [F, D] with
M = T*K rows, each timed alone forward and forward+backward in the same run; the ratio of their summed time to
the stage's says what the stage costs beyond its matmuls (the permutations, the activation, grouped-GEMM
raggedness), so a fusion is measured where it pays. Each path's two grouped GEMMs are also timed alone in the same
run, on the layout and group sizes the stage's permutation writes (`gemms_*_ms`): the stage's time beyond them
(`outside_gemms_*_ms`) is what the permutation, SwiGLU and unpermutation cost, and what fusing them would save.

Routing: each token's K distinct experts drawn without replacement from expert weights ~ Dirichlet(1) (the
`dirichlet` skew of the grouped-GEMM benchmark, per token), combine weights uniform in [0.5, 1.5). Before it is
timed, the stage is checked against a per-(token, expert) float32 loop on a sample of tokens (outputs, input
gradients, and each expert's weight gradient projected on its weights). Records go into the grouped-GEMM
benchmark's list (`backend` = "stage:<path>").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench.harness import first_line, time_calls
from dropless.core.config import MoEConfig
from dropless.fp8 import Recipe, experts_gmm
from dropless.moe.executor import LocalExecutor
from dropless.moe.permute import permute


@dataclass(frozen=True)
class StageSpec:
    """One model's routed-expert stage: T tokens, K experts each, hidden D, expert width F, E experts."""

    name: str
    tokens: int
    top_k: int
    hidden: int
    width: int
    experts: int
    what: str

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    def flops(self) -> float:
        """The stage's matmul FLOPs forward: gate+up 2*M*D*2F plus down 2*M*F*D."""
        return 2.0 * self.rows * self.hidden * 3 * self.width


STAGES = {s.name: s for s in (
    StageSpec("dsv3-e32", 8192, 8, 7168, 2048, 32, "DeepSeek-V3 widths, 32 local experts, 8,192 tokens"),
    StageSpec("dsv3-e256", 8192, 8, 7168, 2048, 256, "DeepSeek-V3 widths, 256 local experts, 8,192 tokens"),
    StageSpec("qwen3-30b-a3b", 8192, 8, 2048, 768, 128, "Qwen3-30B-A3B, 128 experts, 8,192 tokens"),
    StageSpec("qwen3-next", 8192, 10, 2048, 512, 512, "Qwen3-Next-80B-A3B, 512 experts, top-10, 8,192 tokens"),
    StageSpec("tiny", 64, 2, 32, 16, 4, "CPU smoke test"),
)}
# Which grouped GEMM the stage runs: the layer's default (`moe.gmm_backend=auto`: ours on a GPU, XLA's
# ragged_dot on a CPU), and each FP8 recipe through it.
STAGE_PATHS = ("default", "fp8_blockwise", "fp8_rowwise")
CHECK_TOKENS = 16
# Error limits against the float32 loop: bf16 rounds h, the activation and y in turn (each 2^-9 relative), and
# FP8 adds e4m3's rounding to both products (the grouped-GEMM benchmark's FP8 limit, once per product).
STAGE_ERR_LIMIT = 2e-2
FP8_STAGE_ERR_LIMIT = 0.16


def stage_gmm(path: str):
    """The stage's grouped GEMM: `moe.gmm_backend`'s default, wrapped in Fp8Gmm for an FP8 path."""
    recipe = None if path == "default" else Recipe(path.removeprefix("fp8_"), native=True)
    return experts_gmm(MoEConfig(), recipe)


def routing(spec: StageSpec, seed: int):
    """(expert_ids [T, K] int32, distinct per token; weights [T, K] float32)."""
    rng = np.random.default_rng(seed)
    logits_E = np.log(rng.dirichlet(np.ones(spec.experts)))
    gumbel_TE = rng.gumbel(size=(spec.tokens, spec.experts))
    ids_TK = np.argsort(-(logits_E + gumbel_TE), axis=1)[:, :spec.top_k].astype(np.int32)
    weights_TK = rng.uniform(0.5, 1.5, (spec.tokens, spec.top_k)).astype(np.float32)
    return jnp.asarray(ids_TK), jnp.asarray(weights_TK)


def operands(spec: StageSpec, seed: int):
    """(x [T, D] bf16, dy [T, D] float32, experts in bf16), weights of unit variance over their fan-in. Drawn in
    one jitted program, so no float32 copy of the weights (45 GB at 256 experts) is ever materialised."""
    @jax.jit
    def draw(key):
        keys = jax.random.split(key, 4)
        bf16 = jnp.bfloat16
        x = jax.random.normal(keys[0], (spec.tokens, spec.hidden), bf16)
        dy = jax.random.normal(keys[1], (spec.tokens, spec.hidden), jnp.float32)
        experts = {"gate_up": (jax.random.normal(keys[2], (spec.experts, spec.hidden, 2 * spec.width))
                               / math.sqrt(spec.hidden)).astype(bf16),
                   "down": (jax.random.normal(keys[3], (spec.experts, spec.width, spec.hidden))
                            / math.sqrt(spec.width)).astype(bf16)}
        return x, dy, experts

    return draw(jax.random.key(seed))


def stage_programs(gmm, ids_TK, weights_TK):
    """Jitted (fwd(x, experts) -> y, fwdbwd(x, experts, dy) -> (y, dx, d_experts)) of the stage."""
    executor = LocalExecutor(gmm)

    def fwd(x, experts):
        return executor(x, ids_TK, weights_TK, experts)[0]

    def fwdbwd(x, experts, dy):
        y, pullback = jax.vjp(fwd, x, experts)
        return (y, *pullback(dy))

    return jax.jit(fwd), jax.jit(fwdbwd)


def gemm_programs(gmm, x_TD, ids_TK, experts, seed: int):
    """The stage's two grouped GEMMs alone: ((fwd, fwdbwd, args) for gate+up, the same for down), on the rows and
    group sizes the stage's permutation writes (its layout under FP8: each expert from a multiple of 128), the
    down projection's input and both cotangents drawn like the stage's own."""
    num_experts, width = experts["down"].shape[:2]
    sort = jax.jit(lambda x, ids: permute(x, ids, num_experts, None, gmm.row_align)[:2])
    x_MD, group_sizes_E = sort(x_TD, ids_TK)
    keys = jax.random.split(jax.random.key(seed + 1), 3)
    a_MF = jax.random.normal(keys[0], (x_MD.shape[0], width), x_MD.dtype)
    dh_MF2 = jax.random.normal(keys[1], (x_MD.shape[0], 2 * width), x_MD.dtype)
    dy_MD = jax.random.normal(keys[2], x_MD.shape, x_MD.dtype)

    def product(lhs, weight, cotangent, zero_lhs_grad_padding):
        call = lambda lhs, w: gmm(lhs, w, group_sizes_E, zero_padding=False,  # as routed_experts calls it
                                  zero_lhs_grad_padding=zero_lhs_grad_padding)

        def fwdbwd(lhs, w, ct):
            out, pullback = jax.vjp(call, lhs, w)
            return (out, *pullback(ct))

        return jax.jit(call), jax.jit(fwdbwd), (lhs, weight, cotangent)

    return product(x_MD, experts["gate_up"], dh_MF2, False), product(a_MF, experts["down"], dy_MD, True)


def time_gemms(gmm, x_TD, ids_TK, experts, seed: int, batches: int) -> dict:
    """ms of the stage's two grouped GEMMs alone (`gemm_programs`), forward and forward+backward, summed."""
    fwd_ms = fwdbwd_ms = 0.0
    for fwd, fwdbwd, (lhs, w, ct) in gemm_programs(gmm, x_TD, ids_TK, experts, seed):
        fwd_ms += time_calls(fwd, [(lhs, w)], batches=batches) * 1e3
        fwdbwd_ms += time_calls(fwdbwd, [(lhs, w, ct)], batches=batches) * 1e3
    return {"gemms_fwd_ms": fwd_ms, "gemms_fwdbwd_ms": fwdbwd_ms}


def reference(x_TD, experts, ids_TK, weights_TK, dy_TD):
    """The stage in float32, one (token, expert) pair at a time: (y [T, D] = sum_k w[t, k] * SwiGLU_{e[t, k]}(x[t]),
    dx [T, D] for the cotangent dy, and each expert's weight-gradient projections [E, 2]: <dW, W> for gate+up and
    for down, i.e. the derivative of <y, dy> as that expert's weight is scaled). Each pair's gradients are taken
    inside the loop, so no residual of the loop is kept (a pair's weights in float32 are 117 MB at DeepSeek-V3)."""
    width = experts["down"].shape[1]

    def pair(args):
        x_D, dy_D, e, w = args
        up, down = experts["gate_up"][e].astype(jnp.float32), experts["down"][e].astype(jnp.float32)

        def y_of(x_D, scale_up, scale_down):
            h = x_D @ (scale_up * up)
            return w * ((jax.nn.silu(h[:width]) * h[width:]) @ (scale_down * down))

        y_D, pullback = jax.vjp(lambda x_D: y_of(x_D, 1.0, 1.0), x_D)
        _, y_up_D = jax.jvp(lambda s: y_of(x_D, s, 1.0), (1.0,), (1.0,))
        _, y_down_D = jax.jvp(lambda s: y_of(x_D, 1.0, s), (1.0,), (1.0,))
        return y_D, pullback(dy_D)[0], jnp.stack([y_up_D @ dy_D, y_down_D @ dy_D])

    top_k = ids_TK.shape[1]
    x_MD = jnp.repeat(x_TD.astype(jnp.float32), top_k, axis=0)
    dy_MD = jnp.repeat(dy_TD.astype(jnp.float32), top_k, axis=0)
    y_MD, dx_MD, projections_M2 = jax.lax.map(pair, (x_MD, dy_MD, ids_TK.reshape(-1), weights_TK.reshape(-1)))
    per_token = lambda a_MD: jnp.sum(a_MD.reshape(-1, top_k, a_MD.shape[-1]), axis=1)
    num_experts = experts["down"].shape[0]
    return per_token(y_MD), per_token(dx_MD), jax.ops.segment_sum(projections_M2, ids_TK.reshape(-1), num_experts)


@jax.jit
def weight_projections(d_experts, experts):
    """[E, 2]: <dW_e, W_e> for gate+up and down, accumulated in float32 (no float32 copy of the weights)."""
    dot = lambda g, w: jnp.einsum("ekn,ekn->e", g, w.astype(g.dtype), preferred_element_type=jnp.float32)
    return jnp.stack([dot(d_experts["gate_up"], experts["gate_up"]), dot(d_experts["down"], experts["down"])], -1)


def check(spec: StageSpec, fwdbwd, x, dy, experts, ids_TK, weights_TK) -> dict:
    """Relative errors of the stage's output, input gradient and weight gradient (`reference`'s projections) on
    CHECK_TOKENS tokens against `reference`. The weight gradient is the stage's for a cotangent that is zero but
    on those tokens, so it holds exactly their pairs' contributions."""
    pick = np.linspace(0, spec.tokens - 1, min(CHECK_TOKENS, spec.tokens)).astype(np.int32)
    y, dx = fwdbwd(x, experts, dy)[:2]  # the weight gradient, as large as the weights, is not kept
    y, dx = np.asarray(y[pick]), np.asarray(dx[pick])
    _, _, d_experts = fwdbwd(x, experts, jnp.zeros_like(dy).at[pick].set(dy[pick]))
    projections = np.asarray(weight_projections(d_experts, experts))
    del d_experts
    ref_y, ref_dx, ref_projections = reference(x[pick], experts, ids_TK[pick], weights_TK[pick], dy[pick])

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

    return {"fwd": rel(y, ref_y), "dlhs": rel(dx, ref_dx), "drhs": rel(projections, ref_projections)}


def dense_reference(spec: StageSpec, batches: int) -> dict:
    """The stage's two matmuls as dense matmuls of equal FLOPs, each forward and forward+backward: ms each."""
    keys = jax.random.split(jax.random.key(7), 4)
    bf16 = jnp.bfloat16
    shapes = {"up": (spec.hidden, 2 * spec.width), "down": (spec.width, spec.hidden)}
    out = {}
    for name, (k, n) in shapes.items():
        xs = [jax.random.normal(keys[i], (spec.rows, k), bf16) for i in (0, 1)]
        w = (jax.random.normal(keys[2], (k, n), jnp.float32) / math.sqrt(k)).astype(bf16)
        dy = jax.random.normal(keys[3], (spec.rows, n), bf16)
        fwd = jax.jit(lambda x, w: jnp.dot(x, w))

        def fb(x, w, dy):
            out_, pullback = jax.vjp(lambda x, w: jnp.dot(x, w), x, w)
            return (out_, *pullback(dy))

        out[f"{name}_fwd_ms"] = time_calls(fwd, [(x, w) for x in xs], batches=batches) * 1e3
        out[f"{name}_fwdbwd_ms"] = time_calls(jax.jit(fb), [(x, w, dy) for x in xs], batches=batches) * 1e3
    return out


def bench_stage(spec: StageSpec, paths, env: dict, *, seed: int = 0, batches: int = 5, log=print) -> list[dict]:
    """The dense reference, then each path's stage: checked, then timed. One record each."""
    x, dy, experts = operands(spec, seed)
    ids_TK, weights_TK = routing(spec, seed)
    base = {"shape": f"stage:{spec.name}", "m": spec.rows, "k": spec.hidden, "n": spec.width, "g": spec.experts,
            "tokens": spec.tokens, "top_k": spec.top_k, "skew": "dirichlet"} | env
    dense = dense_reference(spec, batches)
    dense_fwd_ms = dense["up_fwd_ms"] + dense["down_fwd_ms"]
    dense_fwdbwd_ms = dense["up_fwdbwd_ms"] + dense["down_fwdbwd_ms"]
    flops = spec.flops()
    records = [base | {"backend": "stage:dense", **dense, "fwd_ms": dense_fwd_ms, "fwdbwd_ms": dense_fwdbwd_ms,
                       "fwd_tflops": flops / dense_fwd_ms / 1e9, "fwdbwd_tflops": 3 * flops / dense_fwdbwd_ms / 1e9,
                       "error": None, "max_rel_err": None}]
    log(f"stage {spec.name}: dense equivalent {dense_fwd_ms:.2f} ms fwd, {dense_fwdbwd_ms:.2f} ms fwd+bwd "
        f"({records[0]['fwdbwd_tflops']:.0f} TF/s)")
    for path in paths:
        rec = base | {"backend": f"stage:{path}", "error": None, "max_rel_err": None,
                      "dense_fwd_ms": dense_fwd_ms, "dense_fwdbwd_ms": dense_fwdbwd_ms}
        try:
            gmm = stage_gmm(path)
            rec["gmm"] = gmm.name
            fwd, fwdbwd = stage_programs(gmm, ids_TK, weights_TK)
            rec["rel_err"] = check(spec, fwdbwd, x, dy, experts, ids_TK, weights_TK)
            rec["max_rel_err"] = max(rec["rel_err"].values())
            limit = STAGE_ERR_LIMIT if path == "default" else FP8_STAGE_ERR_LIMIT
            if not rec["max_rel_err"] <= limit:
                raise AssertionError(f"relative error {rec['rel_err']} > {limit}: not timed")
            t_fwd = time_calls(fwd, [(x, experts)], batches=batches)
            t_fb = time_calls(fwdbwd, [(x, experts, dy)], batches=batches)
            rec |= {"fwd_ms": t_fwd * 1e3, "fwdbwd_ms": t_fb * 1e3, "fwd_tflops": flops / t_fwd / 1e12,
                    "fwdbwd_tflops": 3 * flops / t_fb / 1e12,
                    "fwd_vs_dense": dense_fwd_ms / (t_fwd * 1e3), "fwdbwd_vs_dense": dense_fwdbwd_ms / (t_fb * 1e3)}
            rec |= time_gemms(gmm, x, ids_TK, experts, seed, batches)
            rec |= {"outside_gemms_fwd_ms": rec["fwd_ms"] - rec["gemms_fwd_ms"],
                    "outside_gemms_fwdbwd_ms": rec["fwdbwd_ms"] - rec["gemms_fwdbwd_ms"]}
            log(f"stage {spec.name} {path:14s} ({gmm.name}) fwd {rec['fwd_ms']:.2f} ms = {rec['fwd_vs_dense']:.0%} "
                f"of dense, fwd+bwd {rec['fwdbwd_ms']:.2f} ms = {rec['fwdbwd_vs_dense']:.0%}, "
                f"err {rec['max_rel_err']:.1e}; its grouped GEMMs alone {rec['gemms_fwd_ms']:.2f} / "
                f"{rec['gemms_fwdbwd_ms']:.2f} ms")
        except Exception as e:  # noqa: BLE001 - a failing path is a result, not a crash
            rec["error"] = first_line(e)
            log(f"stage {spec.name} {path:14s} FAILED: {rec['error']}")
        records.append(rec)
    return records


def markdown_table(records: list[dict]) -> str:
    """Per stage and path: fwd and fwd+bwd time, and the dense equivalent's share of it (1 = as fast as dense)."""
    lines = ["| stage | path | fwd ms | fwd+bwd ms | its grouped GEMMs alone fwd / fwd+bwd ms | "
             "dense equivalent fwd / fwd+bwd ms | stage vs dense (fwd / fwd+bwd) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        if not r["shape"].startswith("stage:") or r["backend"] == "stage:dense":
            continue
        name, path = r["shape"].removeprefix("stage:"), r["backend"].removeprefix("stage:")
        if r.get("error"):
            lines.append(f"| {name} | {path} | – | – | – | – | {r['error'][:60]} |")
            continue
        gemms = (f"{r['gemms_fwd_ms']:.2f} / {r['gemms_fwdbwd_ms']:.2f}" if "gemms_fwd_ms" in r else "–")
        lines.append(f"| {name} | {path} | {r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.2f} | {gemms} | "
                     f"{r['dense_fwd_ms']:.2f} / {r['dense_fwdbwd_ms']:.2f} | {r['fwd_vs_dense']:.0%} / **{r['fwdbwd_vs_dense']:.0%}** |")
    return "\n".join(lines)
