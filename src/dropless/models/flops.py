"""Model FLOPs per token, the numerator of throughput and MFU figures.

Training FLOPs per token (forward + backward = 3 x forward; a multiply-add is 2 FLOPs):

    model_flops_per_token = 6 * N_active_matmul + 6 * (L + L_mtp) * S * H * (Q + W) / 2

- `N_active_matmul`: the active parameters per token (`transformer.param_counts`: dense weights, shared experts,
  top-k routed experts, router) *without the embedding table*, whose gather does no arithmetic, but *with* the
  output projection to the vocabulary (lm_head, or the tied embedding used as one). Norm weights are included;
  they are a negligible 2*D per layer.
- Multi-token prediction (`model.mtp_layers` = L_mtp): each module's weights are in N_active_matmul, and each
  module applies the shared output head once more, so the head's V*D weights count 1 + L_mtp times.
- The attention term counts the two score matmuls each parameter-count misses: q k^T (width Q per head) and
  probs @ v (width W per head), over S keys, for H query heads in each of the L + L_mtp layers, halved because causal
  attention needs only the lower triangle. Q = qk_nope + qk_rope and W = v_head_dim for MLA; Q = W = head_dim
  for GQA. S is the training sequence length (every token of a packed sequence attends to S/2 keys on average).

Recomputation for rematerialisation is deliberately not counted: these are *model* FLOPs, so MFU compares
configurations fairly.
"""

from __future__ import annotations

from dropless.core.config import Config
from dropless.models.transformer import param_breakdown, param_counts


def attention_head_widths(config: Config) -> tuple[int, int]:
    """(Q, W): per-head query/key width and value width."""
    m = config.model
    if m.attention == "mla":
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return m.head_dim, m.head_dim


def matmul_params_per_token(config: Config) -> int:
    """Active parameters that take part in a matmul for each token (see the module docstring)."""
    _, active = param_counts(config)
    parts = param_breakdown(config)
    m = config.model
    # The embedding gather is free; with tied embeddings the same matrix is the output projection, counted once.
    head = parts["embed"] if m.tie_embeddings else parts["lm_head"]
    return active - (0 if m.tie_embeddings else parts["embed"]) + m.mtp_layers * head


def attention_flops_per_token(config: Config, seq_len: int) -> int:
    """Training FLOPs per token of the causal score matmuls: 6 * (L + L_mtp) * S * H * (Q + W) / 2."""
    qk_width, v_width = attention_head_widths(config)
    return 3 * (config.model.num_layers + config.model.mtp_layers) * seq_len * config.model.num_heads * (qk_width + v_width)


def model_flops_per_token(config: Config, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token: 6 * N_active_matmul + 6 * (L + L_mtp) * S * H * (Q + W) / 2."""
    return 6 * matmul_params_per_token(config) + attention_flops_per_token(config, seq_len)
