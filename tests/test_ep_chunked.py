"""moe.dispatch_chunks: each device's tokens through the strategy in chunks; same result, the accounting adds up."""

import numpy as np
import pytest

from dropless.core.config import Config, ConfigError, MoEConfig, ParallelConfig
from dropless.ep import AllGather, AllToAll, Auto, Chunked, NoDispatch, make_strategy
from tests.ep_cases import (SKEWED_BIAS, STRATEGIES, assert_executor_matches_local, assert_matches_single_device,
                            balanced_inputs, executor, problem)


@pytest.mark.parametrize("name,expert_parallel", [("allgather", 2), ("alltoall", 4)])
def test_chunked_dispatch_matches_single_device_and_adds_up_the_accounting(name, expert_parallel):
    """moe.dispatch_chunks: each device's 8 tokens in 2 chunks; same output and gradients, the same rows sent as one
    exchange (dedup is per token, so chunks change nothing), and an overflow in a chunk is reported."""
    case = problem(seed=11)
    whole = assert_matches_single_device(STRATEGIES[name], expert_parallel, case)
    chunked = assert_matches_single_device(Chunked(STRATEGIES[name], 2), expert_parallel, case)
    assert int(chunked.rows_sent) == int(whole.rows_sent)
    assert int(chunked.rows_sent_without_dedup) == int(whole.rows_sent_without_dedup)
    skewed = problem(seed=7, bias_E=SKEWED_BIAS)
    strategy = Chunked(AllToAll(buffer_factor=1.0), 2)
    assert int(assert_matches_single_device(strategy, 4, skewed).dispatch_overflowed) == 1


def test_chunked_dispatch_config_and_errors():
    tiny = Config(moe=MoEConfig(num_experts=8, dispatch_chunks=2), parallel=ParallelConfig(expert=4))
    assert make_strategy(tiny) == Chunked(Auto(2.0, True), 2)
    assert make_strategy(tiny.replace(**{"parallel.expert": 1})) == NoDispatch()
    with pytest.raises(ConfigError, match="moe.dispatch_chunks"):
        MoEConfig(dispatch_chunks=0)
    with pytest.raises(ConfigError, match="moe.dispatch_chunks=3 does not divide the 8 tokens"):
        assert_matches_single_device(Chunked(AllGather(), 3), 2, problem(seed=1))


def test_chunked_resolves_to_its_inner_strategy_for_one_chunk():
    """What runs per chunk is decided at the chunk's shape: 4096 tokens in 2 chunks of 2048."""
    assert Chunked(Auto(1.25), 2).resolve(num_tokens=4096, top_k=8, num_devices=8, num_local=4) == AllToAll(1.25)
    # 2 tokens per chunk, top-8 of 32 over 8 devices: a slot of 2.0 x the balanced load holds the whole chunk
    assert Chunked(Auto(2.0), 2).resolve(num_tokens=4, top_k=8, num_devices=8, num_local=4) == AllGather()


@pytest.mark.parametrize("token", [0, 4])
def test_an_overflow_in_one_chunk_alone_is_reported(token):
    """Each device's 8 tokens in 2 chunks of 4 whose experts are {0, 1}, {2, 3}, {4, 5}, {6, 7} (rotated): one row
    per destination, the slots of buffer factor 1 exactly. Device 0's token 0 (first chunk) or 4 (second chunk)
    moves to experts 2 and 1: only that chunk overflows, and the layer reports it."""
    tokens = np.arange(64)
    first_T = (2 * (tokens % 4) + tokens // 8) % 8  # each device's pairs of experts rotated by its index
    ids_TK = np.stack([first_T, (first_T + 1) % 8], 1)
    ids_TK[token] = [2, 1]
    stats = assert_executor_matches_local(executor(Chunked(AllToAll(buffer_factor=1.0), 2), 8),
                                          *balanced_inputs(ids_TK))
    assert int(stats.dispatch_overflowed) == 1
