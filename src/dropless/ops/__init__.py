"""dropless.ops: small numerical building blocks shared by the model and the MoE layer (matmul, norms, RoPE)."""
