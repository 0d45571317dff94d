"""A DeepSeek-V3-shaped model small enough to compile a whole training step on a 2-core CPU in seconds."""

from __future__ import annotations

from dropless.core.config import Config, load_preset

MICRO = {
    "model.num_layers": 2, "model.hidden_size": 32, "model.vocab_size": 64, "model.num_heads": 2,
    "model.q_lora_rank": 16, "model.kv_lora_rank": 16, "model.qk_nope_head_dim": 8, "model.qk_rope_head_dim": 8,
    "model.v_head_dim": 8, "model.dense_intermediate_size": 32, "moe.num_experts": 4, "moe.n_group": 2,
    "moe.topk_group": 1, "moe.expert_intermediate_size": 16, "train.batch_size": 2, "train.seq_len": 8,
    "moe.gmm_backend": "xla",
}


def micro_config(**overrides) -> Config:
    """The `tiny` preset shrunk to one dense and one MoE layer of width 32; `overrides` use dotted keys."""
    return load_preset("tiny").replace(**{**MICRO, **overrides})
