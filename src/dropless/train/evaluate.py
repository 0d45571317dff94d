"""`dropless eval`: a model's mean next-token cross-entropy over a token stream, every token scored once.

The stream is cut as training cuts its splits (sequence i = stream[i*S : i*S + S + 1], so each token after the
first is a target exactly once; the trailing partial sequence is left out) and scored in batches of
`train.batch_size` on the training mesh (`train.setup.build`: any layout of the config, FSDP included), in
`train.grad_accum_steps` microbatches where one batch would not fit. A last, partial batch is filled with copies
of the first sequences, weighted 0: the loss is the sum of every scored token's cross-entropy over their count,
summed in float64 on the host, not a mean of batch means. Routing is per token, so the filling rows change no
other row's result (`moe.gmm_backend=capacity`, whose capacity a batch's tokens share, needs whole batches).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from dropless.core.config import Config
from dropless.data import DataError, TokenStream
from dropless.models import transformer
from dropless.train import setup as setup_lib
from dropless.train.step import microbatches, split_batch


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What one evaluation measured: `loss` is the mean cross-entropy (nats) of the `tokens` scored."""

    loss: float
    tokens: int
    sequences: int
    seq_len: int
    tokens_dropped: int

    @property
    def perplexity(self) -> float:
        return math.inf if self.loss > 709 else math.exp(self.loss)  # exp overflows near 709.8; NaN stays NaN


def _row_losses(config: Config, executor) -> Callable:
    """(params, model_state, batch [B, S+1]) -> (each row's summed cross-entropy [B] float32, tokens dropped)."""
    def rows(params, model_state, batch_BS1):
        inputs_BS, targets_BS = split_batch(batch_BS1)
        logits_BSV, aux = transformer.forward(params, model_state, inputs_BS, config, executor=executor,
                                              training=False)
        per_token_BS = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS)
        moe = aux.get("moe")
        dropped = jnp.sum(moe.tokens_dropped).astype(jnp.int32) if moe is not None else jnp.zeros((), jnp.int32)
        return jnp.sum(per_token_BS.astype(jnp.float32), axis=1), dropped

    count = config.train.grad_accum_steps
    if count == 1:
        return rows

    def in_microbatches(params, model_state, batch_BS1):
        def one(_, micro_BS1):
            return None, rows(params, model_state, micro_BS1)
        _, (sums_CN, dropped_C) = jax.lax.scan(one, None, microbatches(batch_BS1, count))
        # Microbatch i holds rows i, i + count, ... (`microbatches`): back to the batch's row order.
        return jnp.swapaxes(sums_CN, 0, 1).reshape(-1), jnp.sum(dropped_C)
    return in_microbatches


def evaluate(config: Config, params, model_state, stream: TokenStream, *, max_sequences: int | None = None,
             setup: setup_lib.StepSetup | None = None, log: Callable[[str], None] | None = None) -> Evaluation:
    """Score `stream` (or its first `max_sequences` sequences) with the model, at `train.seq_len` tokens a
    sequence, in batches of `train.batch_size` on the mesh `config.parallel` describes (`setup`'s, where the
    caller has built it)."""
    log = log or (lambda message: None)
    tc = config.train
    S, B = tc.seq_len, tc.batch_size
    count = max(len(stream) - 1, 0) // S
    if max_sequences is not None:
        count = min(count, max_sequences)
    if count == 0:
        raise DataError(f"the data holds {len(stream)} tokens, fewer than one sequence of train.seq_len+1={S + 1}; "
                        "give more data or a lower train.seq_len.")
    if config.moe.gmm_backend == "capacity" and count % B:
        # Capacity is shared by a batch's tokens: the filling copies would take some, and count as dropped.
        raise DataError(f"moe.gmm_backend=capacity drops tokens by batch, so a partial last batch ({count % B} of "
                        f"{B} sequences) would be scored differently for its filling; make the number of sequences "
                        f"({count}) a multiple of train.batch_size={B}, with --max-sequences or train.batch_size.")
    setup = setup or setup_lib.build(config)
    shardings = setup.state_shardings
    params = jax.device_put(params, shardings.params)
    model_state = jax.device_put(model_state, shardings.model_state)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    score = jax.jit(_row_losses(config, setup.executor),
                    in_shardings=(shardings.params, shardings.model_state, setup.batch_sharding),
                    out_shardings=(replicated, replicated))
    batches = -(-count // B)
    log(f"dropless: scoring {count:,} sequences of {S:,} tokens in {batches:,} batch(es) of {B}")
    lo, hi = setup_lib.process_rows(B)
    results = []
    for first in range(0, count, B):
        rows = np.arange(first, first + B)
        weights = rows < count
        rows = np.where(weights, rows, rows % count)
        local_BS1 = stream.windows(rows[lo:hi] * S, S + 1)
        batch_BS1 = setup_lib.global_batch(local_BS1, setup.batch_sharding, B)
        results.append((score(params, model_state, batch_BS1), weights))
        if len(results) > 2:  # the host cuts the next batch while the device scores this one, and runs no further
            jax.block_until_ready(results[-3][0])
    total, dropped = 0.0, 0
    for (sums_B, dropped_here), weights in results:
        total += float(np.sum(np.asarray(sums_B, np.float64)[weights]))
        dropped += int(dropped_here)
    return Evaluation(total / (count * S), count * S, count, S, dropped)
