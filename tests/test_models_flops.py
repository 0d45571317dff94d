"""Model FLOPs per token: 6 x active matmul parameters (from the actual parameter shapes) + the causal attention term."""

from __future__ import annotations

import math

import jax
import pytest

from dropless.core.config import load_preset
from dropless.models import flops, transformer


def _active_matmul_params_from_shapes(config) -> int:
    """Count from init_params' shapes: every leaf but the embedding gather, routed experts at top-k / E, the output
    head once more for each MTP module."""
    shapes = jax.eval_shape(lambda key: transformer.init_params(key, config), jax.random.key(0))
    moe = config.moe
    count = 0
    for path, leaf in jax.tree.leaves_with_path(shapes):
        name, size = jax.tree_util.keystr(path), math.prod(leaf.shape)
        if name == "['embed']":
            count += size if config.model.tie_embeddings else 0  # tied: the same matrix is the output projection
        elif "['experts']" in name:
            count += size * moe.num_experts_per_tok // moe.num_experts
        else:
            count += size
        if name == ("['embed']" if config.model.tie_embeddings else "['lm_head']"):
            count += config.model.mtp_layers * size
    return count


@pytest.mark.parametrize("name", ["deepseek-v3-671b", "mixtral-8x7b", "qwen3-30b-a3b", "tiny"])  # 671b: with MTP
@pytest.mark.parametrize("tied", [False, True])
def test_model_flops_is_six_active_matmul_params_plus_causal_attention(name, tied):
    config = load_preset(name).replace(**{"model.tie_embeddings": tied})
    m = config.model
    qk, v = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) if m.attention == "mla" else (m.head_dim, m.head_dim)
    seq_len = 1024
    # q k^T and probs v: 2 FLOPs per multiply-add, (qk + v) per head and key, S/2 keys on average (causal),
    # times 3 for forward + backward.
    attention = 3 * 2 * (m.num_layers + m.mtp_layers) * m.num_heads * (qk + v) * seq_len // 2
    assert flops.attention_flops_per_token(config, seq_len) == attention
    assert flops.matmul_params_per_token(config) == _active_matmul_params_from_shapes(config)
    assert flops.model_flops_per_token(config, seq_len) == 6 * _active_matmul_params_from_shapes(config) + attention


def test_deepseek_v3_flops_per_token_at_4k():
    config = load_preset("deepseek-v3-671b").replace(**{"model.mtp_layers": 0})  # the main model's figure
    # 61 layers x 4096 keys x 128 heads x (192 + 128) widths x 3 = 30.7 GFLOPs of causal attention per token.
    assert flops.attention_flops_per_token(config, 4096) == 30_702_305_280
    # 37.55B active parameters less the 0.93B embedding gather, x 6.
    assert flops.model_flops_per_token(config, 4096) / 1e9 == pytest.approx(6 * (37.552 - 0.927) + 30.70, abs=0.05)


def test_mla_attention_counts_the_value_width_apart_from_the_query_key_width():
    """Every MLA preset has v_head_dim == qk_nope_head_dim; a model whose value heads are narrower counts its own
    probs @ v width W, not the query's nope width."""
    config = load_preset("deepseek-v3-671b").replace(**{"model.mtp_layers": 0, "model.v_head_dim": 64})
    m = config.model
    assert flops.attention_head_widths(config) == (m.qk_nope_head_dim + m.qk_rope_head_dim, 64)
    assert flops.attention_flops_per_token(config, 4096) == 3 * m.num_layers * 4096 * m.num_heads * (192 + 64)
