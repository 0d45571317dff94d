"""Speculative decoding with the MTP module against plain decoding, on one trained run (make bench-speculative).

    python benchmarks/speculative.py --run-dir RUN_DIR --out speculative.json [--tokens 128]

For greedy decoding and for sampling (temperature 0.8, top-p 0.95): the tokens per forward pass, the share of
drafts accepted and the wall time per generated token, plain and speculative, on the same four prompts (PROMPTS,
Python openings the stdlib corpus is full of), after a warm-up call of each that compiles its programs; the two
modes take turns prompt by prompt, and each one's time is its fastest of three rounds. Greedy outputs are checked
equal token for token. Both decode with KV caches (dropless.models.generate): a speculative pass runs the main
model over two positions instead of one, then the MTP block, so tokens per pass bound the speed-up.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dropless.bench.records import environment, write_json
from dropless.data.tokenizer import read_tokenizer_file
from dropless.models.generate import generate
from dropless.train import checkpoint as ckpt

PROMPTS = ("def ", "import os\n", "class ", "    return ")


ROUNDS = 3


def measure(config, params, state, prompts, tokens: int, temperature: float) -> tuple[dict, dict]:
    """(plain, speculative) on every prompt, the two interleaved prompt by prompt so that a slower spell of the
    machine falls on both; each mode's time is its fastest of ROUNDS rounds."""
    # The warm-up compiles every program the measurement runs: the cache's length follows the token budget.
    for speculative in (False, True):
        generate(config, params, state, prompts[0], max_new_tokens=tokens, temperature=temperature,
                 speculative=speculative)
    results = {}
    for speculative in (False, True):
        results[speculative] = {"outputs": [], "forwards": 0, "drafted": 0, "accepted": 0, "tokens": 0,
                                "rounds": [0.0] * ROUNDS}
    for round_ in range(ROUNDS):
        for seed, prompt in enumerate(prompts):
            for speculative, r in results.items():
                stats: dict = {}
                t0 = time.perf_counter()
                ids = generate(config, params, state, prompt, max_new_tokens=tokens, temperature=temperature,
                               seed=seed, speculative=speculative, stats=stats)
                r["rounds"][round_] += time.perf_counter() - t0
                if round_ == 0:  # the same ids and counts every round
                    r["outputs"].append(ids)
                    for name in ("forwards", "drafted", "accepted"):
                        r[name] += stats[name]
                    r["tokens"] += len(ids)
    rows = []
    for r in results.values():
        rows.append({"outputs": r["outputs"], "tokens": r["tokens"], "forwards": r["forwards"],
                     "tokens_per_forward": r["tokens"] / r["forwards"],
                     "drafts_accepted": r["accepted"] / r["drafted"] if r["drafted"] else None,
                     "ms_per_token": 1e3 * min(r["rounds"]) / r["tokens"]})
    return rows[0], rows[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    run_dir = Path(a.run_dir)
    tokenizer = read_tokenizer_file(run_dir / "tokenizer.json")
    config, params, state = ckpt.load_model(run_dir)
    prompts = [tokenizer.encode(text).ids for text in PROMPTS]
    rows = []
    for temperature in (0.0, 0.8):
        plain, fast = measure(config, params, state, prompts, a.tokens, temperature)
        if temperature == 0.0:
            assert fast["outputs"] == plain["outputs"], "speculative greedy output differs from plain greedy"
        row = {"temperature": temperature, "plain": plain, "speculative": fast,
               "speedup": plain["ms_per_token"] / fast["ms_per_token"]}
        for r in (plain, fast):
            r.pop("outputs")
        print(f"temperature {temperature}: {fast['tokens_per_forward']:.2f} tokens per pass, drafts accepted "
              f"{fast['drafts_accepted']:.0%}; {plain['ms_per_token']:.1f} -> {fast['ms_per_token']:.1f} ms per token "
              f"({row['speedup']:.2f}x)", flush=True)
        rows.append(row)
    write_json(a.out, {"benchmark": "speculative", "environment": environment(), "run_config": config.to_flat_dict(),
                       "tokens_per_prompt": a.tokens, "prompts": list(PROMPTS), "rows": rows})


if __name__ == "__main__":
    main()
