"""`dropless plan`: whether a training step fits and how fast it runs, per device, before anything is compiled.

`make_plan(config, cluster)` is pure arithmetic over the config's shapes, dtypes and shardings (an abstract mesh:
no device is needed, so a 671B model on 1,024 GPUs plans in a fraction of a second): the per-device memory
(`memory`), the exact state bytes (`layout`), FLOPs, collective bytes and a predicted step time from a rate table
(`cost`), and the fastest layouts that fit (`search`). docs/planning.md describes the model and its accuracy.
"""

from dropless.plan.layout import Cluster, mesh_sizes, state_bytes  # noqa: F401
from dropless.plan.report import Plan, format_plan, make_plan  # noqa: F401
from dropless.plan.search import check_fit, search  # noqa: F401
