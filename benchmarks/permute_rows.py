"""The expert stage's row gathers, each form timed in one run (make bench-permute).

    python benchmarks/permute_rows.py --out FILE.json

At each fine-grained stage's shape (T = 8,192 tokens, its top-k and hidden size, Dirichlet routing as
`dropless bench gmm --stages` draws it), on bfloat16 rows:
- the permutation's gather of token rows into expert order, [T, D] -> [T*K, D]: `jnp.take` with zero fill (a
  bounds check per index), the same promised in bounds, and `permute.take_rows` (rows as uint32 words) with and
  without the promise;
- its backward, each token's K rows gathered and summed in float32: gather, widen, sum as three jnp steps (the
  library's form), and the rows gathered as words and widened by shifting bits (`sum_rows_words`);
- the expert boundaries in the sorted ids: `jnp.searchsorted` by its default scan and by `compare_all`.
Each is checked bit for bit against the first form, timed as the median of batches, and reported in ms and
in GB/s of the bytes it must move at least (each input read once, each output written once: the gather's K
copies of a token row are one read of it, which caches may or may not give).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from dropless.bench import expert_stage
from dropless.bench.harness import time_calls
from dropless.bench.records import environment, write_json
from dropless.moe.permute import _as_words, take_rows


def sum_rows_words(y_MD, rows_TK):
    """sum_k y_MD[rows_TK[:, k]] in float32, bfloat16 rows gathered as uint32 words and each word's two elements
    widened by shifting their bits into place (exact: a bfloat16 is a float32's upper half); element 2j is the
    word's low half."""
    w = jnp.take(_as_words(y_MD), rows_TK, axis=0, mode="fill", fill_value=0)  # [T, K, D/2]
    even = jax.lax.bitcast_convert_type(w << 16, jnp.float32).sum(axis=1)
    odd = jax.lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), jnp.float32).sum(axis=1)
    return jnp.stack([even, odd], axis=-1).reshape(rows_TK.shape[0], y_MD.shape[-1])


def forms(spec, ids_TK):
    """{operation: (bytes moved, {form: (jitted fn, args)})} at one stage's shape."""
    T, K, D, E = spec.tokens, spec.top_k, spec.hidden, spec.experts
    x = jax.random.normal(jax.random.key(0), (T, D), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(1), (T * K, D), jnp.bfloat16)
    flat = ids_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    tokens_M = order // K
    position = jnp.zeros_like(order).at[order].set(jnp.arange(T * K, dtype=jnp.int32))
    rows_TK = position.reshape(T, K)
    sorted_ids = flat[order]
    queries = jnp.arange(E + 1, dtype=jnp.int32)
    row_bytes = 2 * D
    return {
        "gather": ((T + T * K) * row_bytes, {  # each source row read once, each copy written once
            "take_fill": (jax.jit(lambda x, r: jnp.take(x, r, axis=0, mode="fill", fill_value=0)), (x, tokens_M)),
            "take_in_bounds": (jax.jit(lambda x, r: x.at[r].get(mode="promise_in_bounds")), (x, tokens_M)),
            "words_fill": (jax.jit(lambda x, r: take_rows(x, r)), (x, tokens_M)),
            "words_in_bounds": (jax.jit(lambda x, r: take_rows(x, r, in_bounds=True)), (x, tokens_M))}),
        "gather_sum": (T * K * row_bytes + T * row_bytes, {
            "take_widen_sum": (jax.jit(lambda g, r: jnp.sum(jnp.take(g, r, axis=0, mode="fill", fill_value=0)
                                                            .astype(jnp.float32), axis=1).astype(g.dtype)),
                               (g, rows_TK)),
            "sum_rows": (jax.jit(lambda g, r: sum_rows_words(g, r).astype(g.dtype)), (g, rows_TK))}),
        "bounds": (4 * T * K, {
            "searchsorted_scan": (jax.jit(lambda s, q: jnp.searchsorted(s, q, side="left")), (sorted_ids, queries)),
            "searchsorted_compare_all": (jax.jit(lambda s, q: jnp.searchsorted(s, q, side="left",
                                                                               method="compare_all")),
                                         (sorted_ids, queries))}),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="dsv3-e256,qwen3-30b-a3b,qwen3-next")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, default=7)
    a = p.parse_args()
    record = {"benchmark": "permute-rows", "environment": environment(), "results": []}
    for name in a.stages.split(","):
        spec = expert_stage.STAGES[name]
        ids_TK, _ = expert_stage.routing(spec, 0)
        for operation, (nbytes, candidates) in forms(spec, ids_TK).items():
            first = None
            for form, (fn, args) in candidates.items():
                out = np.asarray(jax.block_until_ready(fn(*args)))
                first = out if first is None else first
                same = bool(np.array_equal(out.view(np.uint8), first.view(np.uint8)))
                ms = time_calls(fn, [args], batches=a.batches) * 1e3
                rec = {"stage": name, "operation": operation, "form": form, "ms": ms,
                       "gb_per_s": nbytes / ms / 1e6, "bytes": nbytes, "same_bits_as_first": same}
                record["results"].append(rec)
                print(f"{name:14s} {operation:10s} {form:26s} {ms:7.3f} ms {rec['gb_per_s']:7.0f} GB/s"
                      f"{'' if same else '  DIFFERS'}", flush=True)
        write_json(a.out, record)


if __name__ == "__main__":
    main()
