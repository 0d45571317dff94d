"""dropless.ep: expert parallelism: send each token to the devices that hold its experts, compute, bring it back.

Every strategy (`moe.dispatch`) is a dispatcher with the same contract (dropless.ep.contract): `dispatch`
(rows out, with the metadata its `combine` needs), the local experts (the single-device permute -> grouped
GEMM -> unpermute), and `combine` (partial results back, summed per token), run by one shared skeleton.
- `allgather` (ep.allgather): every device gathers its group's tokens; a reduce-scatter returns the sums.
- `alltoall` (ep.alltoall): fixed slots per destination, a worst-case exchange on overflow; never a drop.
- `ragged` (ep.ragged): `ragged_all_to_all` moves exactly the rows needed (GPU only).
- `auto` (ep.auto): alltoall or allgather, per shape; `moe.dispatch_chunks` (ep.chunked): in chunks.
Who sends what where, with deduplication (`moe.dedup`), is ep.plan; rows towards the experts may travel in
FP8 (`moe.dispatch_dtype=float8`, every strategy: ep.wire). ep.executor wraps it all in one `shard_map` and
builds the executor from the config (`make_executor`).
"""

from dropless.ep.allgather import AllGather
from dropless.ep.alltoall import AllToAll
from dropless.ep.auto import Auto
from dropless.ep.chunked import Chunked
from dropless.ep.contract import Dispatcher, LocalExperts, Received, Strategy, exchange
from dropless.ep.executor import ExpertParallelExecutor, NoDispatch, make_executor, make_strategy
from dropless.ep.ragged import Ragged
from dropless.ep.wire import Wire

__all__ = [
    "AllGather", "AllToAll", "Auto", "Chunked", "Dispatcher", "ExpertParallelExecutor", "LocalExperts",
    "NoDispatch", "Ragged", "Received", "Strategy", "Wire", "exchange", "make_executor", "make_strategy",
]
