"""The sender's plan: deduplication sends a token once per device and changes nothing else."""

import dataclasses

import pytest

from tests.ep_cases import STRATEGIES, assert_matches_single_device, problem


@pytest.mark.parametrize("name", ["alltoall", "ragged"])
def test_dedup_sends_fewer_rows_and_changes_nothing(name):
    case = problem(seed=4)
    undeduplicated = dataclasses.replace(STRATEGIES[name], dedup=False)
    without = assert_matches_single_device(undeduplicated, 4, case)
    with_dedup = assert_matches_single_device(STRATEGIES[name], 4, case)  # compiled above, for this problem
    assert int(with_dedup.rows_sent) < int(without.rows_sent) == int(without.rows_sent_without_dedup)
    assert int(with_dedup.rows_sent_without_dedup) == int(without.rows_sent)
