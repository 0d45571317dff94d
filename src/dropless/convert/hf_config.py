"""Hugging Face `config.json` <-> our `Config`, for DeepSeek-V3, Mixtral and Qwen3-MoE.

Reading accepts both config styles found in the wild: the hub's (`rope_theta` + `rope_scaling`, as in
deepseek-ai/DeepSeek-V3 and Qwen/Qwen3-30B-A3B) and transformers 5's (`rope_parameters`). A key that is missing
takes the transformers default of that family. Every key that changes the function the model computes is either
mapped or checked: an unsupported value raises `ConvertError` naming the key, never a silent approximation.
Writing produces the hub style, which every transformers version since the family's introduction reads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dropless.core.config import Config, ConfigError, ModelConfig

ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
FAMILY_ARCHITECTURE = {family: arch for arch, family in ARCHITECTURES.items()}

# transformers' defaults for the keys we read, per family (a config.json may omit any key at its default).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
        norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, initializer_range=0.02, rope_interleave=True),
    "mixtral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=None, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
        initializer_range=0.02, router_aux_loss_coef=0.001, sliding_window=None),
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, head_dim=None, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        initializer_range=0.02, router_aux_loss_coef=0.001),
}

# Keys whose value must be exactly this (or absent) because our model implements only that behaviour.
_REQUIRED = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "scoring_func": "sigmoid",    # DeepSeek-V3 (V2's softmax router is another architecture)
    "topk_method": "noaux_tc",    # DeepSeek-V3's group-limited top-k with the correction bias
    "use_sliding_window": False,  # Qwen3
    "partial_rotary_factor": 1.0,
}
# More layers than any published model has by far; a larger count is a damaged file, not a model to build.
MAX_LAYERS = 10_000
# Keys copied from a source config.json into an export unchanged (they do not change the function).
PASSTHROUGH_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class ConvertError(ConfigError):
    """A Hugging Face checkpoint or config we cannot convert; the message names the item and the fix."""


class ConvertWarning(UserWarning):
    """What an export or import leaves out or changes that the user should know of (`dropless convert` prints it
    as one line)."""


def family_of(hf: dict) -> str:
    """Our model family for an HF config dict, from `architectures` (or `model_type`)."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(arch, str) for arch in archs):
        raise malformed("architectures", archs, 'is not a list of names (like ["DeepseekV3ForCausalLM"])')
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and hf.get("model_type") in FAMILY_ARCHITECTURE:
        return hf["model_type"]
    name = ", ".join(archs) if archs else f"model_type {hf.get('model_type')!r}"
    raise ConvertError(f"Architecture {name} is not supported; the supported ones are "
                       f"{', '.join(ARCHITECTURES)}.")


def _get(hf: dict, family: str, key: str, *aliases: str) -> Any:
    for name in (key, *aliases):
        if name in hf:
            return hf[name]
    return _DEFAULTS[family][key]


def _as(kind: type, key: str, value: Any) -> Any:
    """`kind(value)` (int, float or bool) for a config.json field: a value of another JSON kind (a string, a list,
    a null where a number is needed, a string "false" for a flag), a fraction where an integer is needed (which
    int() would truncate) or NaN or infinity (which Python's json reads) raises ConvertError naming the field, not
    Python's own error or a silently changed value."""
    if kind is bool:
        if not isinstance(value, bool):
            raise malformed(key, value, "is not true or false")
        return value
    if isinstance(value, (str, bool)):  # float("1e-6") and int(True) would read them; transformers refuses them
        raise malformed(key, value, "is not an integer" if kind is int else "is not a number")
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise malformed(key, value, "is not an integer")
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise malformed(key, value, "is not an integer" if kind is int else "is not a number") from None
    if kind is float and not math.isfinite(number):
        raise malformed(key, value, "is not a finite number")
    return number


def _field(hf: dict, family: str, kind: type, key: str, *aliases: str, null: Any = None) -> Any:
    """`_get` as `kind`, with the error naming the key the file holds; `null`, if given, stands in for a null
    (or zero) value, as transformers reads these keys."""
    name = next((n for n in (key, *aliases) if n in hf), key)
    value = _get(hf, family, key, *aliases)
    return _as(kind, name, null if null is not None and not value else value)


def malformed(key: str, value: Any, fault: str) -> ConvertError:
    """The error for a config.json field the file got wrong: `fault` says how ("is not a number")."""
    return ConvertError(f"config.json field {key}={value!r} {fault}; correct it in config.json or re-download the "
                        "checkpoint.")


def _unsupported(key: str, value: Any, supported: str) -> ConvertError:
    return ConvertError(f"config.json field {key}={value!r} is not supported; dropless supports {supported}.")


def rope_settings(hf: dict, family: str) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling or None) from either config style."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise malformed(key, value, "is not an object")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise _unsupported("rope_parameters", "per-layer-type RoPE", "one RoPE setting for all layers")
    theta = _as(float, "rope_theta", hf.get("rope_theta", params.get("rope_theta", _DEFAULTS[family]["rope_theta"])))
    merged = {**params, **scaling}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if merged.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _unsupported("partial_rotary_factor", merged.get("partial_rotary_factor"), "1.0 (full rotary width)")
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise _unsupported("rope_scaling.type", kind, "'yarn' or no scaling")
    max_pos = _field(hf, family, int, "max_position_embeddings")
    original = _as(int, "rope_scaling.original_max_position_embeddings", merged.get("original_max_position_embeddings")
                   or hf.get("original_max_position_embeddings") or max_pos)
    # transformers derives a missing factor the same way
    factor = _as(float, "rope_scaling.factor", merged.get("factor") or (max_pos / original if original else 0))
    out = {"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        if merged.get(key) is not None:
            out[key] = _as(float, f"rope_scaling.{key}", merged[key])
    if merged.get("truncate") is not None:
        out["truncate"] = _as(bool, "rope_scaling.truncate", merged["truncate"])
    return theta, out


def _check_required(hf: dict) -> None:
    for key, want in _REQUIRED.items():
        if key in hf and hf[key] != want and not (want is False and hf[key] is None):
            raise _unsupported(key, hf[key], repr(want))


def _deepseek_is_moe(layer: int, first_k_dense: int, freq: int) -> bool:
    # DeepSeek's own modelling code (transformers reads first_k_dense_replace alone, i.e. moe_layer_freq = 1).
    return layer >= first_k_dense and layer % freq == 0


def layer_letters(hf: dict, family: str, count: int) -> str:
    """The type, D (dense) or M (MoE), of HF layers 0..count-1 (`count` beyond num_hidden_layers: the MTP
    layers, numbered after the main ones) by the family's rule: DeepSeek's first_k_dense_replace and
    moe_layer_freq, Qwen3-MoE's mlp_only_layers and decoder_sparse_step; Mixtral's layers are all MoE."""
    if family == "mixtral":
        return "M" * count
    if family == "deepseek_v3":
        first_k = _field(hf, family, int, "first_k_dense_replace", null=0)
        freq = hf.get("moe_layer_freq")  # null: every layer from first_k_dense_replace on; 0 is refused below
        freq = _as(int, "moe_layer_freq", 1 if freq is None else freq)
        if freq < 1:
            raise _unsupported("moe_layer_freq", freq, "a positive layer interval")
        return "".join("M" if _deepseek_is_moe(i, first_k, freq) else "D" for i in range(count))
    step = _field(hf, family, int, "decoder_sparse_step")
    if step < 1:
        raise _unsupported("decoder_sparse_step", step, "a positive layer interval")
    only = _get(hf, family, "mlp_only_layers") or []
    if not isinstance(only, list):
        raise malformed("mlp_only_layers", only, "is not a list of layer numbers")
    only = {_as(int, "mlp_only_layers", layer) for layer in only}
    return "".join("D" if i in only or (i + 1) % step != 0 else "M" for i in range(count))


def _pattern_keys(letters: str) -> dict:
    """first_dense_layers and, where the layers are not a dense prefix then MoE, the explicit pattern."""
    leading = len(letters) - len(letters.lstrip("D"))
    prefix_only = letters == "D" * leading + "M" * (len(letters) - leading)
    return {"first_dense_layers": leading, "layer_pattern": "" if prefix_only else letters}


def _deepseek_rule(letters: str) -> dict | None:
    """first_k_dense_replace and moe_layer_freq reproducing `letters` by DeepSeek's rule (moe_layer_freq 1 where it
    can be), or None where no pair does."""
    count = len(letters)
    for freq in range(1, count + 1):
        for first_k in range(count + 1):
            if all((letter == "M") == _deepseek_is_moe(i, first_k, freq) for i, letter in enumerate(letters)):
                return {"first_k_dense_replace": first_k, "moe_layer_freq": freq}
    return None


def _deepseek_layer_keys(m: ModelConfig) -> dict:
    """DeepSeek's rule for the main layers followed by the MTP layers (HF numbers them after the main ones and types
    them by the same rule), or ConvertError naming what to change."""
    letters = m.layer_types + ("M" if m.mtp_block == "moe" else "D") * m.mtp_layers
    keys = _deepseek_rule(letters)
    if keys is not None:
        return keys
    rule = ("cannot be expressed in a DeepseekV3ForCausalLM config.json (its layers are dense before "
            "first_k_dense_replace and then MoE every moe_layer_freq-th layer)")
    if m.mtp_layers and _deepseek_rule(m.layer_types) is not None:  # the MTP layers' type is what breaks the rule
        raise ConvertError(f"model.mtp_block={m.mtp_block!r} after model.layer_pattern={m.layer_types!r} {rule}: "
                           f"HF types the MTP layers, numbered {m.num_layers} on, by the same rule "
                           f"({letters!r}); change model.mtp_block or the layer pattern.")
    raise ConvertError(f"model.layer_pattern={m.layer_types!r} {rule}; export to qwen3_moe, whose mlp_only_layers "
                       "holds any pattern, or change the model.")


def config_from_hf(hf: dict, base: Config | None = None) -> Config:
    """Our Config for an HF config.json dict; train/data/parallel come from `base` (defaults if None)."""
    family = family_of(hf)
    _check_required(hf)

    def get(key: str, *aliases: str) -> Any:
        return _get(hf, family, key, *aliases)

    def integer(key: str, *aliases: str, null: int | None = None) -> int:
        return _field(hf, family, int, key, *aliases, null=null)

    def real(key: str, *aliases: str) -> float:
        return _field(hf, family, float, key, *aliases)

    def flag(key: str) -> bool:
        return _field(hf, family, bool, key)

    theta, rope_scaling = rope_settings(hf, family)
    if theta <= 0:
        raise malformed("rope_theta", theta, "is not positive")
    num_layers = integer("num_hidden_layers")
    hidden, heads = integer("hidden_size"), integer("num_attention_heads")
    max_len = integer("max_position_embeddings")
    mtp_layers = (_as(int, "num_nextn_predict_layers", hf.get("num_nextn_predict_layers") or 0)
                  if family == "deepseek_v3" else 0)
    for key, count in (("num_hidden_layers", num_layers), ("num_nextn_predict_layers", mtp_layers)):
        if count > MAX_LAYERS:  # before layer_letters spells out one letter per layer
            raise malformed(key, count, f"is beyond the {MAX_LAYERS} layers dropless builds")
    eps = real("rms_norm_eps")
    if eps <= 0:  # RMSNorm divides by sqrt(mean square + eps): a negative eps gives NaN for small inputs
        raise malformed("rms_norm_eps", eps, "is not positive")
    letters = layer_letters(hf, family, num_layers + mtp_layers)
    if mtp_layers and len(set(letters[num_layers:])) > 1:
        raise _unsupported("num_nextn_predict_layers", mtp_layers, "MTP layers all dense or all MoE")
    model = dict(family=family, vocab_size=integer("vocab_size"), hidden_size=hidden, num_layers=num_layers,
                 **_pattern_keys(letters[:num_layers]), num_heads=heads, mtp_layers=mtp_layers,
                 mtp_block="moe" if letters[num_layers:][:1] != "D" else "dense",
                 rope_theta=theta, rope_scaling=rope_scaling, max_seq_len=max_len,
                 rms_norm_eps=eps,
                 tie_embeddings=flag("tie_word_embeddings"),
                 init_std=real("initializer_range"))
    if family == "deepseek_v3":
        model.update(attention="mla", dense_intermediate_size=integer("intermediate_size"),
                     q_lora_rank=integer("q_lora_rank", null=0), kv_lora_rank=integer("kv_lora_rank"),
                     qk_rope_head_dim=integer("qk_rope_head_dim"), qk_nope_head_dim=integer("qk_nope_head_dim"),
                     v_head_dim=integer("v_head_dim"))
        moe = dict(num_experts=integer("n_routed_experts", "num_local_experts"),
                   expert_intermediate_size=integer("moe_intermediate_size"),
                   num_shared_experts=integer("n_shared_experts", null=0), score_func="sigmoid",
                   norm_topk_prob=flag("norm_topk_prob"),
                   routed_scaling_factor=real("routed_scaling_factor"),
                   n_group=integer("n_group", null=1), topk_group=integer("topk_group", null=1))
        if hf.get("seq_aux") and hf.get("aux_loss_alpha"):  # the official config's sequence-wise balance loss
            moe["seq_aux_loss_weight"] = _as(float, "aux_loss_alpha", hf["aux_loss_alpha"])
    else:
        head_dim = integer("head_dim", null=hidden // heads if heads else 0)  # ModelConfig refuses 0 heads
        model.update(attention="gqa", num_kv_heads=integer("num_key_value_heads", null=heads), head_dim=head_dim,
                     qk_norm=family == "qwen3_moe")
        window = hf.get("sliding_window")
        window = None if window is None else _as(int, "sliding_window", window)
        if family == "mixtral" and window is not None and window < max_len:
            raise _unsupported("sliding_window", window, f"null (or >= max_position_embeddings={max_len})")
        if family == "mixtral":
            width = integer("intermediate_size")
            model["dense_intermediate_size"] = width
            moe = dict(num_experts=integer("num_local_experts", "num_experts"), expert_intermediate_size=width,
                       norm_topk_prob=True)
        else:
            model["dense_intermediate_size"] = integer("intermediate_size")
            moe = dict(num_experts=integer("num_experts", "num_local_experts"),
                       expert_intermediate_size=integer("moe_intermediate_size"),
                       norm_topk_prob=flag("norm_topk_prob"))
        moe.update(num_shared_experts=0, score_func="softmax", routed_scaling_factor=1.0, n_group=1, topk_group=1,
                   aux_loss_weight=real("router_aux_loss_coef"))
    moe["num_experts_per_tok"] = integer("num_experts_per_tok")
    base = base or Config()
    train = base.train
    if train.seq_len > max_len:  # keep the Config valid for models with a short context
        train = dataclasses.replace(train, seq_len=max_len)
    try:
        return Config(model=ModelConfig(**model), moe=dataclasses.replace(base.moe, **moe), train=train,
                      data=base.data, parallel=base.parallel)
    except ConfigError as err:
        raise ConvertError(f"config.json describes a model dropless cannot build: {err}") from None


def config_to_hf(config: Config, source: dict | None = None, dtype: str = "float32") -> dict:
    """The HF config.json dict for our Config. `source`: the config.json it was imported from, if any, whose
    token ids are kept."""
    m, moe, family = config.model, config.moe, config.model.family

    def req(ok: bool, key: str, want: str) -> None:
        if not ok:
            group, name = key.split(".")
            value = getattr(m if group == "model" else moe, name)
            raise ConvertError(f"{key}={value!r} cannot be expressed in a {FAMILY_ARCHITECTURE[family]} "
                               f"config.json (it needs {want}); export to a family that has it or change the model.")

    hf: dict[str, Any] = {"architectures": [FAMILY_ARCHITECTURE[family]], "model_type": family,
                          "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
                          "num_attention_heads": m.num_heads, "max_position_embeddings": m.max_seq_len,
                          "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": m.tie_embeddings,
                          "rope_theta": m.rope_theta, "hidden_act": "silu", "initializer_range": m.init_std,
                          "num_experts_per_tok": moe.num_experts_per_tok, "torch_dtype": dtype}
    if m.rope_scaling is not None:
        hf["rope_scaling"] = {**{k: v for k, v in m.rope_scaling.items() if k != "rope_type"}, "type": "yarn",
                              "rope_type": "yarn"}
    if family == "deepseek_v3":
        req(m.attention == "mla", "model.attention", "'mla'")
        req(moe.score_func == "sigmoid", "moe.score_func", "'sigmoid'")
        hf.update(intermediate_size=m.dense_intermediate_size, moe_intermediate_size=moe.expert_intermediate_size,
                  num_key_value_heads=m.num_heads, n_shared_experts=moe.num_shared_experts,
                  n_routed_experts=moe.num_experts, routed_scaling_factor=moe.routed_scaling_factor,
                  kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank or None,
                  qk_rope_head_dim=m.qk_rope_head_dim, qk_nope_head_dim=m.qk_nope_head_dim, v_head_dim=m.v_head_dim,
                  n_group=moe.n_group, topk_group=moe.topk_group, norm_topk_prob=moe.norm_topk_prob,
                  rope_interleave=True, attention_bias=False, scoring_func="sigmoid", topk_method="noaux_tc",
                  num_nextn_predict_layers=m.mtp_layers)
        hf.update(_deepseek_layer_keys(m))
        if moe.seq_aux_loss_weight > 0:
            hf.update(seq_aux=True, aux_loss_alpha=moe.seq_aux_loss_weight)
    else:
        req(m.attention == "gqa", "model.attention", "'gqa'")
        req(m.mtp_layers == 0, "model.mtp_layers", "0 (multi-token prediction is DeepSeek-V3's)")
        req(moe.score_func == "softmax", "moe.score_func", "'softmax'")
        req(moe.num_shared_experts == 0, "moe.num_shared_experts", "0")
        req(moe.n_group == 1, "moe.n_group", "1")
        req(math.isclose(moe.routed_scaling_factor, 1.0), "moe.routed_scaling_factor", "1.0")
        req(m.qk_norm == (family == "qwen3_moe"), "model.qk_norm", str(family == "qwen3_moe"))
        hf.update(num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
                  router_aux_loss_coef=moe.aux_loss_weight)
        if family == "mixtral":
            req("D" not in m.layer_types, "model.layer_pattern" if m.layer_pattern else "model.first_dense_layers",
                "MoE layers only")
            req(moe.norm_topk_prob, "moe.norm_topk_prob", "True")
            hf.update(intermediate_size=moe.expert_intermediate_size, num_local_experts=moe.num_experts,
                      sliding_window=None)
        else:
            hf.update(intermediate_size=m.dense_intermediate_size, moe_intermediate_size=moe.expert_intermediate_size,
                      num_experts=moe.num_experts, norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=[i for i, t in enumerate(m.layer_types) if t == "D"], attention_bias=False,
                      use_sliding_window=False, sliding_window=None)
    for key in PASSTHROUGH_KEYS:
        if source and key in source:
            hf[key] = source[key]
    return dict(sorted(hf.items()))
