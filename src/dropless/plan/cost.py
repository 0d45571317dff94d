"""FLOPs, bytes per collective and the predicted time of one training step, from a per-device rate table.

The table (`rates.json` beside this file, one entry per device kind; `dropless bench rates` measures one on the
present device) gives dense-matmul, grouped-GEMM (by rows per local expert, `gmm_rate`), attention, HBM, link and
host-copy rates, each with its source. The step's time is

    compute (dense matmuls, grouped GEMMs, attention; + the recomputed forward under remat)
  + memory-bound passes (activations written and read, and written again where remat recomputes them; the loss
    over the vocabulary; the optimizer update)
  + the expert-parallel exchanges (on the critical path of every MoE layer)
  + the FSDP gathers and gradient reductions that the compute does not hide
  + host copies (an offloaded optimizer state or offloaded activations)
  + under `train.scan_layers`, passes over the loop's stacked buffers (`SCAN_PASSES`)
  + a fixed per-step overhead.

FLOPs are `dropless.models.flops`'s model FLOPs (forward + backward) plus the recomputation remat adds, each kind
at its own rate (`step_flops`); under `train.fp8` the grouped GEMMs and every dense matmul but the output head at
the recipe's measured speed-up over bf16 (`fp8_speedup`, quantization included).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jax.numpy as jnp

from dropless.core.config import Config, ConfigError
from dropless.models import flops as flops_lib
from dropless.models import transformer
from dropless.plan.layout import Cluster, abstract_mesh, mesh_axes_of, model_facts, shard_shape
from dropless.plan.memory import MemoryPlan, blocks, moe_buffers

# Passes over the saved activations per step: written in the forward, read in the backward, and their
# cotangents written and read once.
ACTIVATION_PASSES = 4
# Passes over the activations remat does not keep: the forward writes them and drops them, the recomputation
# writes them again, the backward reads them, and their cotangents are written and read.
RECOMPUTED_PASSES = ACTIVATION_PASSES + 1
# Under `jax.lax.scan` the step copies every layer's residuals into stacked buffers (dynamic-update-slice) and
# reads them back, and zero-fills and accumulates the stacked weights' float32 gradients: passes over those bytes
# (`MemoryPlan.stacked_bytes`), not a share of the compute, so that remat, which leaves little to stack, also
# leaves little of this cost. Four passes fit the scanned proxy at 1 and 4 x 2,048 tokens under each remat mode
# (benchmarks/results/step-batch1-h200.json, step-h200.json: rungs 4, 5:remat=moe, 5:remat=full against
# 5:unrolled) within -5% to +3%, and the 4-layer qwen3-30b-a3b without remat and with remat=full
# (plan-calibration-h200.json) at +3% and +12%. (A share of the compute cannot fit both: it charges remat=full,
# which computes more, more for the scan, where the GPU measures less.)
SCAN_PASSES = 4.0
# Passes over the [T, V] float32 logits: the matmul's output, the softmax, its gradient, the gradient's read.
LOGIT_PASSES = 4


def load_rates(path: str | Path | None = None) -> dict:
    """The rate table: the packaged one, or a JSON file of the same form (`dropless bench rates --out`), checked
    for every rate the model reads."""
    if path is None:
        return json.loads(resources.files("dropless.plan").joinpath("rates.json").read_text())
    fix = "give a file written by 'dropless bench rates --out'."
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"--rates {path} is a directory; {fix}")
    try:
        table = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--rates {path} does not exist; {fix}") from None
    except OSError as err:
        raise ConfigError(f"--rates {path} cannot be read ({err.strerror}); {fix}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"--rates {path} is not valid JSON ({err.msg}); {fix}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--rates {path} is not valid JSON (not UTF-8 text); {fix}") from None
    if not isinstance(table, dict) or not table or not all(isinstance(v, dict) for v in table.values()):
        raise ConfigError(f"--rates {path} is not a rate table (an object of device kinds, each an object of "
                          f"rates); {fix}")
    for device in table:
        rates = device_rates(table, device)
        missing = [name for name in RATE_NAMES
                   if not _number(value := _lookup(rates, name)) or value < 0 or (value == 0 and name != OVERHEAD)]
        points = _lookup(rates, "gmm_tflops.by_rows_per_expert")
        if not (isinstance(points, list) and points and all(
                isinstance(p, dict) and _number(p.get("rows")) and p["rows"] > 0 and _number(p.get("value"))
                and p["value"] > 0 for p in points)):
            missing.insert(1, "gmm_tflops.by_rows_per_expert (a list of {\"rows\": R, \"value\": TF/s})")
        if missing:
            raise ConfigError(f"--rates {path}: device '{device}' lacks a positive number for {', '.join(missing)}; "
                              f"{fix}")
    return table


# Every rate the model reads, as paths into a device's entry.
RATE_NAMES = ("dense_tflops", "attention_tflops", "hbm_gbps",
              "link_gbps.intra_host", "link_gbps.inter_host", "host_gbps", "step_overhead_ms", "memory_gib")
OVERHEAD = "step_overhead_ms"  # the one rate that may be 0


def _lookup(entry: dict, name: str):
    for part in name.split("."):
        entry = entry.get(part) if isinstance(entry, dict) else None
    return entry


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def device_rates(rates: dict, device: str) -> dict:
    """One device kind's rates as plain numbers ({"dense_tflops": 690, "gmm_tflops": {...}, ...})."""
    if device not in rates:
        raise ConfigError(f"the rate table has no device '{device}'; choose one of {', '.join(sorted(rates))} "
                          "or measure one with 'dropless bench rates'.")

    def values(node):
        if isinstance(node, dict) and "value" in node:
            return node["value"]
        if isinstance(node, dict):
            return {k: values(v) for k, v in node.items() if k != "source"}
        return node

    return values(rates[device])


def gmm_rate(rates: dict, rows_per_expert: float) -> float:
    """The grouped GEMM's forward + backward TFLOP/s at `rows_per_expert` rows per local expert: the table's
    measured points (`gmm_tflops.by_rows_per_expert`), interpolated linearly in log(rows) and held flat beyond the
    first and last. Rows per expert set what the kernels lose to a group's last, partly filled row tile and how
    many FLOPs each weight byte read or written carries, so they, not the expert count, pick the rate."""
    points = sorted((p["rows"], p["value"]) for p in rates["gmm_tflops"]["by_rows_per_expert"])
    if rows_per_expert <= points[0][0]:
        return points[0][1]
    for (r0, v0), (r1, v1) in zip(points, points[1:]):
        if rows_per_expert <= r1:
            t = math.log(rows_per_expert / r0) / math.log(r1 / r0)
            return v0 + t * (v1 - v0)
    return points[-1][1]


def rate_key(rates: dict, device_kind: str, platform: str) -> str:
    """The rate table's entry for a device: the key its kind names ("NVIDIA H200" -> "H200"), else the first entry
    of its platform."""
    for key in rates:
        if key.lower() in device_kind.lower():
            return key
    same = [key for key, entry in rates.items() if entry.get("platform") == platform]
    if not same:
        raise ConfigError(f"the rate table has no entry for {device_kind} ({platform}); measure one with "
                          "'dropless bench rates --out FILE' and pass it with --rates.")
    return same[0]


@dataclass(frozen=True)
class Collective:
    name: str
    bytes_per_device: int  # bytes each device sends per step
    within_host: bool

    def seconds(self, rates: dict) -> float:
        link = rates["link_gbps"]["intra_host" if self.within_host else "inter_host"]
        return self.bytes_per_device / (link * 1e9)


def collectives(config: Config, sizes: dict[str, int], cluster: Cluster) -> list[Collective]:
    """Bytes each device sends per step, by collective: FSDP's weight gathers (forward and backward) and gradient
    reduce-scatters, the data-parallel gradient all-reduce, and the MoE layers' dispatch and combine."""
    train, m = config.train, config.model
    c = jnp.dtype(train.dtype).itemsize
    devices = cluster.devices
    mesh = abstract_mesh(sizes)
    micro = train.grad_accum_steps
    fsdp, expert = sizes["fsdp"], sizes["expert"]
    gather = scatter = allreduce = 0.0
    for _, spec in model_facts(config)[0]:
        local = math.prod(shard_shape(mesh, spec.shape, spec.axes))
        full = math.prod(spec.shape)
        shards = full // local
        replicas = devices // shards
        if "fsdp" in mesh_axes_of(mesh, spec.shape, spec.axes):
            gather += 2 * micro * (fsdp - 1) * local * c  # forward and backward, every microbatch
            scatter += micro * (fsdp - 1) * local * c  # the compute-dtype cotangents (the cast is fused)
        if replicas > 1:
            allreduce += 2 * (replicas - 1) / replicas * local * 4
    out = []
    fsdp_in_host = fsdp * expert <= cluster.gpus_per_host
    if gather:
        out.append(Collective("fsdp_all_gather", int(gather), fsdp_in_host))
        out.append(Collective("fsdp_reduce_scatter", int(scatter), fsdp_in_host))
    if allreduce:
        out.append(Collective("gradient_all_reduce", int(allreduce), devices <= cluster.gpus_per_host))
    num_moe = blocks(m)[1]
    if expert > 1 and num_moe:
        tokens = train.batch_size // micro * train.seq_len // devices
        buffers = moe_buffers(config, sizes, tokens)
        wire = 1 if config.moe.dispatch_dtype == "float8" else c
        # Per layer and microbatch: dispatch and combine in the forward, their transposes in the backward
        # (and the forward again under remat).
        passes = 2 + (1 if train.remat in ("moe", "full") else 0)
        per_layer = buffers.exchange_rows * m.hidden_size * (wire + c)
        out.append(Collective(f"moe_{buffers.strategy}", int(passes * per_layer * num_moe * micro),
                              expert <= cluster.gpus_per_host))
    return out


def _layer_weight(path: tuple[str, ...]) -> tuple[str, ...] | None:
    """A weight's path inside its transformer block (the main model's layers and each MTP module's block, the
    part `train.remat` checkpoints), or None for a weight outside every block (the embedding, the output head,
    the final norm, and each MTP module's input norms, `eh_proj` and head norm)."""
    if path[0] in ("dense_layers", "moe_layers"):
        return path[1:]
    if path[:2] == ("mtp", "block"):
        return path[2:]
    return None


def _recomputed_weights(config: Config) -> tuple[int, int]:
    """(every block's, the MoE blocks') weights whose forward matmul a recomputed block runs again, routed
    experts aside (they count as grouped GEMMs). A block's last projection whose output is only added to the
    residual stream (the dense MLP's and the shared experts' `down`) is not needed by the backward pass, and
    JAX's partial evaluation leaves it out of the recomputation; the routed experts' down projection stays in
    it (the gradient of the routing weights reads its output)."""
    layers = moe = 0
    for path, spec in model_facts(config)[0]:
        block = _layer_weight(path)
        if block is None or block[:2] == ("moe", "experts") or (block[-1] == "down" and block[0] in ("mlp", "moe")):
            continue
        size = math.prod(spec.shape)
        layers += size
        moe += size if block[0] == "moe" else 0  # the router and the shared experts' gate/up projection
    return layers, moe


def router_common_flops(config: Config) -> tuple[float, float]:
    """(FLOPs of one step, of one recomputed forward) of the routers' common-direction removal
    (moe.router_common_rate), dense: per router, the running mean's fold into the kernel (a [D] x [D, E] product,
    forward and backward) and, with moe.router_common_source=other_sequences in training, each token's component
    along its direction (a [T, D] x [D] product, forward and backward) and the directions' logits ([B, D] x [D, E]).
    Negligible beside the router itself (6 T D E), counted so that the plan's FLOPs stay the step's."""
    moe, m, train = config.moe, config.model, config.train
    if moe.router_common_rate == 0:
        return 0.0, 0.0
    routers = transformer.num_router_rows(m)
    d, e = m.hidden_size, moe.num_experts
    sequences = train.batch_size // train.grad_accum_steps
    if moe.router_common_source == "other_sequences" and sequences > 1:
        per_pass = 2 * (train.batch_size * train.seq_len * d + train.batch_size * d * e)
    else:
        per_pass = 2 * d * e * train.grad_accum_steps
    return routers * 2 * per_pass, routers * per_pass


def step_flops(config: Config) -> dict[str, float]:
    """Global FLOPs of one step by kind: dense matmuls, grouped GEMMs, attention scores, and the forward that
    remat recomputes in the backward pass (model FLOPs exclude it), in total and by the same kinds.

    The MTP modules count like the main model: their routed experts as grouped GEMMs, their blocks' other
    weights, input projection and application of the shared output head as dense matmuls. A recomputed forward
    costs a third of its blocks' forward + backward: under `full` every block's matmuls (main layers and MTP
    blocks; the output head and the MTP input projections stay outside them), grouped GEMMs and attention
    scores; under `moe` each MoE block's router, shared experts and grouped GEMMs (`_recomputed_weights`). The
    routers' common-direction removal adds its few dense FLOPs (`router_common_flops`)."""
    train, moe, m = config.train, config.moe, config.model
    tokens = train.batch_size * train.seq_len
    _, parts, (_, active) = model_facts(config)
    routed = 6 * (parts["routed_experts"] + parts["mtp_routed_experts"]) * moe.num_experts_per_tok // moe.num_experts
    # flops.matmul_params_per_token and model_flops_per_token, from the cached counts
    head = parts["embed"] if m.tie_embeddings else parts["lm_head"]
    matmul = active - (0 if m.tie_embeddings else parts["embed"]) + m.mtp_layers * head
    dense = 6 * matmul - routed
    attention = flops_lib.attention_flops_per_token(config, train.seq_len)
    again = {"dense": 0.0, "grouped": 0.0, "attention": 0.0}
    common, common_again = router_common_flops(config)
    if train.remat in ("moe", "full"):
        layer_weights, moe_weights = _recomputed_weights(config)
        recomputed = layer_weights if train.remat == "full" else moe_weights
        again = {"dense": 2 * recomputed + common_again / tokens, "grouped": routed / 3,
                 "attention": attention / 3 if train.remat == "full" else 0.0}
    return {"dense": tokens * dense + common, "head": tokens * 6 * (1 + m.mtp_layers) * head,
            "grouped": tokens * routed, "attention": tokens * attention,
            "recompute": tokens * sum(again.values()),
            **{f"recompute_{kind}": tokens * value for kind, value in again.items()},
            "model": tokens * (6 * matmul + attention)}


def step_time(config: Config, sizes: dict[str, int], cluster: Cluster, memory: MemoryPlan, rates: dict) -> dict:
    """Predicted seconds of one step, by term (see the module docstring), and the collectives."""
    train = config.train
    devices = cluster.devices
    f = step_flops(config)
    # FP8 recipes run every matmul but the output head (and the router) at their measured speed-up over bf16.
    fp8 = rates.get("fp8_speedup", {}).get(train.fp8, {}) if train.fp8 != "off" else {}
    # Balanced routing gives each device's local experts its own T*K rows (under expert parallelism, from the
    # whole expert group).
    local_experts = config.moe.num_experts // sizes["expert"]
    device_tokens = train.batch_size // train.grad_accum_steps * train.seq_len // devices
    rows_per_expert = device_tokens * config.moe.num_experts_per_tok / local_experts
    grouped_rate = gmm_rate(rates, rows_per_expert) * fp8.get("grouped", 1.0)
    dense_rate = rates["dense_tflops"]
    compute = (f["head"] / (dense_rate * 1e12)
               + (f["dense"] - f["head"] + f["recompute_dense"]) / (dense_rate * fp8.get("dense", 1.0) * 1e12)
               + (f["grouped"] + f["recompute_grouped"]) / (grouped_rate * 1e12)
               + (f["attention"] + f["recompute_attention"]) / (rates["attention_tflops"] * 1e12)) / devices
    hbm = rates["hbm_gbps"] * 1e9
    micro = train.grad_accum_steps
    logits = train.batch_size * train.seq_len // devices * config.model.vocab_size * 4
    moments = memory.optimizer_state
    optimizer_bytes = 2 * memory.parameters + memory.gradient_buffers + 2 * moments
    activation_bytes = ACTIVATION_PASSES * memory.activations + RECOMPUTED_PASSES * memory.recomputed_activations
    memory_bound = (activation_bytes * micro + LOGIT_PASSES * logits + optimizer_bytes) / hbm
    comm = collectives(config, sizes, cluster)
    exposed_ep = sum(x.seconds(rates) for x in comm if x.name.startswith("moe_"))
    hidden = sum(x.seconds(rates) for x in comm if not x.name.startswith("moe_"))
    exposed_other = max(0.0, hidden - compute)
    host = 0.0
    if train.offload_optimizer:
        host += 2 * moments / (rates["host_gbps"] * 1e9)
    if memory.activations_in_host:
        host += 2 * memory.activations_in_host * micro / (rates["host_gbps"] * 1e9)
    overhead = rates["step_overhead_ms"] / 1e3
    scan = SCAN_PASSES * memory.stacked_bytes * micro / hbm
    seconds = compute + memory_bound + scan + exposed_ep + exposed_other + host + overhead
    tokens = train.batch_size * train.seq_len
    return {
        "seconds": seconds,
        "terms_s": {"compute": compute, "memory_bound": memory_bound, "expert_exchange": exposed_ep,
                    "scan_buffers": scan, "fsdp_and_gradient_sync_exposed": exposed_other, "host_copies": host,
                    "overhead": overhead},
        "flops": f,
        "grouped_gemm": {"rows_per_expert": rows_per_expert, "tflops": grouped_rate},
        "collectives": [{"name": x.name, "bytes_per_device": x.bytes_per_device, "within_host": x.within_host,
                         "seconds": x.seconds(rates)} for x in comm],
        "tokens_per_s": tokens / seconds,
        "model_tflops_per_device": f["model"] / seconds / devices / 1e12,
    }
