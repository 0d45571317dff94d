"""Hugging Face interchange: DeepSeek-V3, Mixtral and Qwen3-MoE checkpoints in and out, streamed tensor by tensor.

    convert_from_hf(hf_dir, run_dir) -> Config             HF directory -> new run directory
    convert_to_hf(run_dir, hf_dir, dtype=None) -> step     run directory -> HF directory (sharded safetensors)
    load_hf(hf_dir) -> (Config, params, state)             HF directory -> in-memory model (no run directory)
    compute_logits(config, params, state, tokens_BS)       float32 logits [B, S, V], computed in float32
    check_tokens(tokens_BS, config)                        int32 [B, S] token ids the model can take, or ConvertError
"""

from dropless.convert.api import check_tokens, compute_logits, convert_from_hf, convert_to_hf, load_hf
from dropless.convert.hf_config import (ARCHITECTURES, ConvertError, ConvertWarning, config_from_hf,
                                        config_to_hf)

__all__ = ["ARCHITECTURES", "ConvertError", "ConvertWarning", "check_tokens", "compute_logits", "config_from_hf",
           "config_to_hf", "convert_from_hf", "convert_to_hf", "load_hf"]
