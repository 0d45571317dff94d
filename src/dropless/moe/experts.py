"""SwiGLU experts: the routed experts as two grouped GEMMs, and the dense shared experts.

SwiGLU(x) = (silu(x @ gate) * (x @ up)) @ down, with gate and up fused into one `gate_up` weight
(`gate_up[..., :F]` = gate, `gate_up[..., F:]` = up) so one GEMM computes both.
Shapes: M permuted rows, D hidden, E experts, F expert width.
Matmuls run in the dtype of their inputs with float32 accumulation; the activation is computed in float32.
The routed down projection returns the compute dtype, like every other layer's output: the combine that
follows sums each token's K weighted rows in float32, and at bf16 a float32 [M, D] here would double the
bytes of the largest activation and of its cotangent, which the backward then had to cast back to bf16
(a pass of its own over the layer's largest buffer). The shared experts' output stays float32 (one [T, D] row each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.core.params import ParamSpec, Specs
from dropless.gmm.api import GroupedMatmul
from dropless.fp8 import Recipe, linear


def _glu(h_MF2: jax.Array, dtype) -> jax.Array:
    gate_MF, up_MF = jnp.split(h_MF2.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate_MF) * up_MF).astype(dtype)


def routed_experts(x_sorted_MD: jax.Array, group_sizes_E: jax.Array, experts: dict,
                   gmm: GroupedMatmul, *, remat_activation: bool = False) -> jax.Array:
    """Each row of x_sorted through its own expert's SwiGLU: [M, D] -> [M, D] in x_sorted's dtype; the rows past
    sum(group_sizes) are unspecified (read them through `unpermute`, which ignores them), and so are those rows of
    x_sorted's gradient: x_sorted must come from `permute`, whose backward never reads them (a gather whose
    transpose is a scatter-add over every row would take them in).

    `remat_activation`: the backward keeps only h and recomputes the activation. For code inside a lax.cond
    (expert parallelism's bounded buffer), whose residuals are materialised at the cond's boundary: there the
    activation's float32 intermediates ([M, F] each) cost more memory traffic than recomputing them. Elsewhere
    XLA fuses them away, and the remat would cost an extra pass over h.
    """
    dtype = x_sorted_MD.dtype
    weight = (lambda w: w) if gmm.weights_as_stored else (lambda w: w.astype(dtype))
    # Padding rows (past sum(group_sizes): a bounded or worst-case buffer's spare rows) are left unwritten by both
    # GEMMs: the activation is row by row, the down projection reads only rows of a group, and `unpermute` reads
    # only rows that hold a pair. Zeroing them was a pass of its own over h and y inside expert parallelism's
    # lax.cond, where XLA cannot fuse it into the reader. So is the gate+up's input gradient's: x_sorted comes
    # from `permute`, whose backward reads only the rows that hold a pair.
    with jax.named_scope("gmm_up"):
        h_MF2 = gmm(x_sorted_MD, weight(experts["gate_up"]), group_sizes_E, zero_padding=False,
                    zero_lhs_grad_padding=False)
    glu = jax.checkpoint(_glu, static_argnums=(1,)) if remat_activation else _glu
    a_MF = glu(h_MF2, dtype)
    with jax.named_scope("gmm_down"):
        return gmm(a_MF, weight(experts["down"]), group_sizes_E, zero_padding=False)


def dense_swiglu(x_TD: jax.Array, weights: dict, recipe: Recipe | None = None, mesh=None) -> jax.Array:
    """The shared experts (and any dense SwiGLU MLP): [T, D] -> [T, D] float32; FP8 matmuls with a `recipe`, per
    batch shard over `mesh` (T batch-major)."""
    h_TF2 = linear(x_TD, weights["gate_up"], recipe, mesh=mesh)
    return linear(_glu(h_TF2, x_TD.dtype), weights["down"], recipe, out_dtype=jnp.float32, mesh=mesh)


def swiglu_params(hidden_size: int, width: int, num_experts: int | None = None) -> Specs:
    """SwiGLU weights {"gate_up": [D, 2F], "down": [F, D]}, each on a leading `experts` axis [E, ...] when
    `num_experts` is given (the routed experts)."""
    lead, lead_axes = ((), ()) if num_experts is None else ((num_experts,), ("experts",))
    return {"gate_up": ParamSpec((*lead, hidden_size, 2 * width), (*lead_axes, "embed", "mlp")),
            "down": ParamSpec((*lead, width, hidden_size), (*lead_axes, "mlp", "embed"))}
