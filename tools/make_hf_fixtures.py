"""Make the tiny Hugging Face fixtures in tests/fixtures/hf/, or check an exported checkpoint against them.

Needs `torch` and `transformers` (optional extras, not project dependencies); run it with any Python that has them:

    python tools/make_hf_fixtures.py                      # (re)write every fixture
    python tools/make_hf_fixtures.py --verify-export OUT_DIR --fixture deepseek_v3
        # load OUT_DIR (e.g. written by `dropless convert --from RUN --to-hf OUT_DIR`) with transformers and
        # require its logits on the fixture's tokens to match the fixture's expected logits
    python tools/make_hf_fixtures.py --verify-export OUT_DIR --tokens T.npy --expected L.npy
        # the same for any exported model, e.g. against `dropless logits --run-dir RUN --tokens T.npy --out L.npy`

Each fixture directory holds what `save_pretrained` writes (config.json and *.safetensors, sharded with an index
for some), `tokens.npy` (int32 [batch, seq]) and `logits.npy` (float32 [batch, seq, vocab], computed by
transformers in float32 from the saved files). Weights are random but not "default": norms, router weights and
DeepSeek-V3's e_score_correction_bias are perturbed so that a swapped norm, a wrong bias or a wrong routing rule
changes the logits. Every fixture is checked for routing margins (no near-tie at a top-k or group boundary), so
float rounding differences between frameworks cannot flip an expert choice and make a test flaky.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
BATCH, SEQ = 2, 24
MIN_ROUTING_MARGIN = 1e-4  # smallest allowed gap between the last chosen and the first rejected score

# Deliberately small and deliberately varied: every option the converter maps is exercised by some fixture.
FIXTURE_CONFIGS = {
    # Group-limited sigmoid routing with a correction bias, a dense first layer, a shared expert, q LoRA,
    # YaRN with mscale != mscale_all_dim (so both the cos/sin factor and the softmax scale differ from 1),
    # and more than one expert per token. Written as two shards with an index.
    "deepseek_v3": dict(
        cls="DeepseekV3ForCausalLM", shard="300KB",
        config=dict(
            vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
            norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
            rope_scaling=dict(type="yarn", rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                              beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8),
            rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.08,
        ),
    ),
    # Queries projected directly (q_lora_rank null), no group limit, no top-k renormalisation, two shared
    # experts, plain RoPE, two dense layers.
    "deepseek_v3_noqlora": dict(
        cls="DeepseekV3ForCausalLM", shard=None,
        config=dict(
            vocab_size=128, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=2, n_shared_experts=2, n_routed_experts=6,
            routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=12,
            qk_nope_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=2,
            norm_topk_prob=False, max_position_embeddings=128, rms_norm_eps=1e-5, num_nextn_predict_layers=0,
            rope_theta=500.0, tie_word_embeddings=False, initializer_range=0.08,
        ),
    ),
    # GQA with head_dim != hidden/heads, softmax top-2 of 4 experts.
    "mixtral": dict(
        cls="MixtralForCausalLM", shard=None,
        config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None,
            tie_word_embeddings=False, initializer_range=0.08, router_aux_loss_coef=0.02,
        ),
    ),
    # q/k norms, norm_topk_prob=True, a dense first layer (mlp_only_layers=[0]), top-3 of 8. Two shards.
    "qwen3_moe": dict(
        cls="Qwen3MoeForCausalLM", shard="200KB",
        config=dict(
            vocab_size=192, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
            norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.08,
            use_sliding_window=False,
        ),
    ),
    # Dense layers between MoE layers (mlp_only_layers=[0, 2] of 4: D M D M), top-2 of 4.
    "qwen3_moe_interleaved": dict(
        cls="Qwen3MoeForCausalLM", shard=None,
        config=dict(
            vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[0, 2], decoder_sparse_step=1, max_position_embeddings=128,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.08,
            use_sliding_window=False,
        ),
    ),
    # DeepSeek's moe_layer_freq (its own modelling code's rule: layer i is MoE when i >= first_k_dense_replace
    # and i % moe_layer_freq == 0), which transformers does not read: the dense layers it implies are swapped in
    # before the weights are drawn and saved (`_build`). 4 layers: D D M D, a dense layer after a MoE layer.
    "deepseek_v3_interleaved": dict(
        cls="DeepseekV3ForCausalLM", shard=None,
        config=dict(
            vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
            routed_scaling_factor=2.0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8,
            qk_nope_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
            moe_layer_freq=2, norm_topk_prob=True, max_position_embeddings=128, rms_norm_eps=1e-6,
            num_nextn_predict_layers=0, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.08,
        ),
    ),
    # norm_topk_prob=False, tied embeddings, YaRN on GQA (cos/sin scaled by the attention factor).
    "qwen3_moe_tied": dict(
        cls="Qwen3MoeForCausalLM", shard=None,
        config=dict(
            vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=6, num_experts_per_tok=2,
            norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=1, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.08,
            rope_scaling=dict(type="yarn", rope_type="yarn", factor=2.0, original_max_position_embeddings=256),
            use_sliding_window=False,
        ),
    ),
}


def _perturb(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Move every "identity" parameter away from its default so that mapping mistakes show in the logits."""
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("gate.weight") and "experts" not in name:  # the router: make choices decisive
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))


def _boundary_gap(values: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the gap between the k-th largest and the (k+1)-th largest value (inf if there is none)."""
    if k >= values.shape[-1]:
        return torch.full(values.shape[:-1], float("inf"))
    top = torch.topk(values, k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


def _routing_margin(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """Smallest decision margin of any router on these tokens (top-k boundary, and group boundary for DeepSeek)."""
    cfg = model.config
    margins: list[float] = []

    def hook(module, inputs, _output):
        x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
        logits = x @ module.weight.float().T
        k = cfg.num_experts_per_tok
        if hasattr(module, "e_score_correction_bias"):
            scores = logits.sigmoid() + module.e_score_correction_bias
            groups, per_group = module.num_group, scores.shape[-1] // module.num_group
            if groups > 1:
                group_scores = scores.view(-1, groups, per_group).topk(2, dim=-1).values.sum(-1)
                margins.append(_boundary_gap(group_scores, module.topk_group).min().item())
                keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(module.topk_group, -1).indices, 1)
                scores = scores.masked_fill(~keep.bool().repeat_interleave(per_group, 1), float("-inf"))
            margins.append(_boundary_gap(scores, k).min().item())
        else:
            margins.append(_boundary_gap(torch.softmax(logits, -1), k).min().item())

    handles = [m.register_forward_hook(hook) for name, m in model.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    assert margins, "no router found"
    return min(margins)


@contextlib.contextmanager
def _deepseek_layer_freq():
    """While active, DeepseekV3 decoder layers follow DeepSeek's moe_layer_freq rule (layer i is MoE when
    i >= first_k_dense_replace and i % moe_layer_freq == 0), which transformers leaves out: the layers it makes
    dense get the dense MLP, both when a model is built and when `from_pretrained` loads one."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    original = deepseek.DeepseekV3DecoderLayer.__init__

    def init(self, config, layer_idx):
        original(self, config, layer_idx)
        freq = getattr(config, "moe_layer_freq", 1) or 1
        if not (layer_idx >= config.first_k_dense_replace and layer_idx % freq == 0):
            self.mlp = deepseek.DeepseekV3MLP(config)

    deepseek.DeepseekV3DecoderLayer.__init__ = init
    try:
        yield
    finally:
        deepseek.DeepseekV3DecoderLayer.__init__ = original


def _build(cls, config) -> torch.nn.Module:
    with _deepseek_layer_freq():
        return cls(config)


def _load(path: Path, cls_name: str) -> torch.nn.Module:
    cls = getattr(transformers, cls_name)
    with _deepseek_layer_freq():
        model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def make_fixture(name: str, spec: dict, out_root: Path) -> None:
    cls = getattr(transformers, spec["cls"])
    config_cls = cls.config_class
    out = out_root / name
    for seed in range(20):  # re-seed until no router decision is a near-tie
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(1000 + seed)
        model = _build(cls, config_cls(**spec["config"])).eval()
        _perturb(model, generator)
        tokens = np.random.default_rng(seed).integers(0, spec["config"]["vocab_size"], (BATCH, SEQ)).astype(np.int32)
        margin = _routing_margin(model, torch.from_numpy(tokens).long())
        if margin >= MIN_ROUTING_MARGIN:
            break
    else:
        raise SystemExit(f"{name}: no seed gave routing margins above {MIN_ROUTING_MARGIN}")
    shutil.rmtree(out, ignore_errors=True)
    kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.save_pretrained(out, **kwargs)
    (out / "generation_config.json").unlink(missing_ok=True)
    # Expected logits come from the saved files, reloaded, so the fixture is self-consistent on disk.
    logits = _logits(_load(out, spec["cls"]), tokens)
    np.save(out / "tokens.npy", tokens)
    np.save(out / "logits.npy", logits.astype(np.float32))
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{name}: seed {seed}, routing margin {margin:.2e}, logits std {logits.std():.3f}, "
          f"{len(list(out.glob('*.safetensors')))} shard(s), {size / 1e3:.0f} kB")


def verify_export(exported: Path, tokens_path: Path, expected_path: Path, tolerance: float) -> float:
    """Load an exported directory with transformers; its logits on the tokens must match the expected ones."""
    config = json.loads((exported / "config.json").read_text())
    tokens = np.load(tokens_path)
    expected = np.load(expected_path)
    logits = _logits(_load(exported, config["architectures"][0]), tokens)
    error = float(np.abs(logits - expected).max())
    print(f"{exported}: {config['architectures'][0]} loads in transformers {transformers.__version__}; "
          f"max |logits - expected logits| = {error:.2e} (largest |logit| {np.abs(expected).max():.2f})")
    if error > tolerance:
        raise SystemExit(f"export check failed: {error:.2e} > {tolerance}")
    return error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURE_CONFIGS), help="fixtures to (re)write")
    parser.add_argument("--out", type=Path, default=FIXTURES, help="where to write the fixtures")
    parser.add_argument("--verify-export", type=Path, help="an exported HF directory to check in transformers")
    parser.add_argument("--fixture", choices=sorted(FIXTURE_CONFIGS), help="the fixture the export came from")
    parser.add_argument("--tokens", type=Path, help="int token ids [batch, seq] (.npy), instead of --fixture")
    parser.add_argument("--expected", type=Path, help="expected float32 logits (.npy), instead of --fixture")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # deterministic reduction order, so an exact export reproduces the logits exactly
    if args.verify_export:
        if args.fixture:
            args.tokens, args.expected = FIXTURES / args.fixture / "tokens.npy", FIXTURES / args.fixture / "logits.npy"
        if not (args.tokens and args.expected):
            parser.error("--verify-export needs --fixture NAME, or --tokens T.npy and --expected L.npy")
        verify_export(args.verify_export, args.tokens, args.expected, args.tolerance)
        return 0
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for name in args.only or sorted(FIXTURE_CONFIGS):
        make_fixture(name, FIXTURE_CONFIGS[name], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
