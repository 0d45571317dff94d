"""Tuned tile configurations of the grouped GEMM, as data keyed by device kind and shape class.

Training a layer y = x·W (x [M, K], rows sorted by group; W [G, K, N]) runs three grouped products:
  fwd   y  = x · W[g]               rows ragged, contracts K
  dlhs  dx = dy · W[g]ᵀ             rows ragged, contracts N
  drhs  dW = x[rows of g]ᵀ · dy     contracts the ragged rows
Each gets its own `ProductConfig` (a kernel and its tile), looked up in `configs.json` beside this
file: device kind -> list of measured shape entries. A shape with no exact entry takes the entry nearest
to it whose tiles divide its dims; a device with no table takes its alias (other Hopper parts use the
H200's table), and anything else gets `DEFAULT_PLAN`. This module is pure Python: nothing here imports
jax or tokamax at module level (only `device_kind` asks jax, only `to_tokamax` imports tokamax), so the
lookup is testable anywhere.

Kernels (`dropless.gmm.dropless_mosaic` maps each name to its functions): "tokamax" is tokamax's Mosaic GPU
ragged_dot (for dlhs/drhs it copies Wᵀ / xᵀ first); "dropless" is `dropless.gmm.mosaic`, which reads W and x
in place; "dropless_ws" is `dropless.gmm.mosaic_ws`, its warp-specialised variant (two consumer warpgroups side
by side: a CTA's output tile is block_m x 2*block_n); "dropless_ws_stream" is the same with one stream of loads
across each CTA's tiles (`mosaic_ws.grouped_matmul_stream`, `grouped_matmul_tn_stream`), and
"dropless_ws_stream_async" the streaming kernels with one MMA left running while each consumer moves to its next
step (`mma_in_flight=1`); "dropless_ws_stacked" (rows products only) the streaming rows kernel with its consumers
stacked along M (`mosaic_ws.grouped_matmul_stacked`: a CTA's output tile is 2*block_m x block_n).
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dropless.core.errors import MoEError
from dropless.core.files import write_atomic

# tokamax's Mosaic GPU ragged-dot module: not part of its public API (tokamax.ops.gpu, which re-exports it,
# also imports tokamax's Triton kernels, which need jax_triton); pyproject.toml pins the tested tokamax release.
TOKAMAX_MOSAIC_MODULE = "tokamax._src.ops.ragged_dot.pallas_mosaic_gpu"


def import_tokamax(module: str = "tokamax"):
    """`module` of tokamax, or one MoEError naming the fix where tokamax is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MoEError(f"this grouped GEMM runs tokamax's kernel, but {module} cannot be imported ({error}); install "
                       "the GPU extra (pip install 'dropless[gpu]') or choose another moe.gmm_backend.") from error


PRODUCTS = ("fwd", "dlhs", "drhs")
KERNELS = ("tokamax", "dropless", "dropless_ws", "dropless_ws_stream", "dropless_ws_stream_async",
           "dropless_ws_stacked")
# Output columns and rows per CTA, in units of block_n and block_m: the warp-specialised kernels' consumers sit side
# by side, the stacked kernel's one above the other.
CTA_COLUMNS = {"tokamax": 1, "dropless": 1, "dropless_ws": 2, "dropless_ws_stream": 2, "dropless_ws_stream_async": 2,
               "dropless_ws_stacked": 1}
CTA_ROWS = {kernel: 2 if kernel == "dropless_ws_stacked" else 1 for kernel in KERNELS}
# The kernels of the rows products only (fwd, dlhs): the stacked kernel's consumers rest where a group's rows end,
# which a weight gradient (contracting the rows) has no use for.
ROWS_ONLY = frozenset({"dropless_ws_stacked"})
SCHEMA_VERSION = 1
DATA_FILE = "configs.json"
_MINOR_DIMS = {"m": 0, "n": 1}


SMEM_BYTES = 227 * 1024  # sm90 shared memory per block


def smem_bytes(config: "ProductConfig", in_itemsize: int = 2, out_itemsize: int = 2) -> int:
    """Shared memory a kernel holds at once: its pipeline stages of both operand blocks plus the output staging
    blocks (one per consumer warpgroup). Exact for "dropless_ws", which keeps both for the whole kernel; the
    single-warpgroup kernels reuse the stages' memory for the output, so this over-counts them."""
    tile, columns, rows = config.tile, CTA_COLUMNS[config.kernel], CTA_ROWS[config.kernel]
    return (in_itemsize * tile.num_stages * (rows * tile.block_m * tile.block_k + tile.block_k * tile.block_n * columns)
            + out_itemsize * rows * columns * tile.block_m * tile.block_n)


class GmmConfigError(MoEError):
    """The tuned-config data file (or a config in it) is malformed; the message names the entry and the fix."""


@dataclass(frozen=True)
class TileConfig:
    """One kernel launch shape. grid_minor_dim: which output-tile axis ("m" or "n") the tile walk advances
    fastest along, in bands of grid_tile_width tiles (for L2 reuse of the operand shared along that band)."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    persistent: bool = True
    grid_minor_dim: int = 1
    grid_tile_width: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 8 or value % 8:
                raise GmmConfigError(f"{name}={value} must be a positive multiple of 8.")
        if not 1 <= self.num_stages <= 8:
            raise GmmConfigError(f"num_stages={self.num_stages} must be between 1 and 8.")
        if self.grid_minor_dim not in (0, 1) or self.grid_tile_width < 1:
            raise GmmConfigError(f"grid_minor_dim={self.grid_minor_dim} must be 0 (m) or 1 (n) and "
                                 f"grid_tile_width={self.grid_tile_width} must be >= 1.")

    def to_tokamax(self):
        """The same tile as tokamax's `PallasMosaicRaggedDotConfig`."""
        # tokamax.ops.gpu would also import tokamax's Triton kernels, which need jax_triton.
        return import_tokamax(TOKAMAX_MOSAIC_MODULE).Config(
            block_m=self.block_m, block_n=self.block_n, block_k=self.block_k, num_stages=self.num_stages,
            split_k=1, persistent=self.persistent, grid_minor_dim=self.grid_minor_dim,
            grid_tile_width=self.grid_tile_width)


# A product's entry in a tuning table: its ProductConfig fields and the time it was measured at.
_PRODUCT_KEYS = frozenset({"kernel", "block_m", "block_n", "block_k", "num_stages", "persistent", "grid_minor_dim",
                           "grid_tile_width", "ms"})


@dataclass(frozen=True)
class ProductConfig:
    """Which kernel computes one product, with which tile."""

    kernel: str
    tile: TileConfig

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise GmmConfigError(f"kernel={self.kernel!r} is not valid; choose one of {', '.join(KERNELS)}.")

    def fits(self, product: str, k: int, n: int) -> bool:
        """Whether this kernel computes the product and its tile divides the output and contraction dims."""
        t = self.tile
        cta_n = t.block_n * CTA_COLUMNS[self.kernel]
        if product == "fwd":  # out [M, N], contracts K
            return n % cta_n == 0 and k % t.block_k == 0
        if product == "dlhs":  # out [M, K], contracts N
            return k % cta_n == 0 and n % t.block_k == 0
        if self.kernel in ROWS_ONLY:
            return False
        return k % t.block_m == 0 and n % cta_n == 0  # drhs: out [G, K, N], contracts rows

    def to_json(self) -> dict[str, Any]:
        t = self.tile
        return {"kernel": self.kernel, "block_m": t.block_m, "block_n": t.block_n, "block_k": t.block_k,
                "num_stages": t.num_stages, "persistent": t.persistent,
                "grid_minor_dim": "mn"[t.grid_minor_dim], "grid_tile_width": t.grid_tile_width}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "config") -> "ProductConfig":
        if not isinstance(d, dict):
            raise GmmConfigError(f"{where} must be an object with kernel, block_m, block_n, block_k and num_stages; "
                                 f"got {type(d).__name__}.")
        unknown = sorted(set(d) - _PRODUCT_KEYS)
        if unknown:
            raise GmmConfigError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; a product config takes "
                                 f"{', '.join(sorted(_PRODUCT_KEYS))}: delete them or re-run `dropless tune-gmm`.")
        try:
            minor = d.get("grid_minor_dim", "n")
            tile = TileConfig(int(d["block_m"]), int(d["block_n"]), int(d["block_k"]), int(d["num_stages"]),
                              bool(d.get("persistent", True)), _MINOR_DIMS[minor] if isinstance(minor, str) else int(minor),
                              int(d.get("grid_tile_width", 1)))
            return cls(str(d["kernel"]), tile)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, GmmConfigError):
                raise GmmConfigError(f"{where}: {e}") from None
            raise GmmConfigError(f"{where} is malformed ({e!r}); it needs kernel, block_m, block_n, block_k, "
                                 f"num_stages and optionally persistent, grid_minor_dim ('m'/'n'), grid_tile_width.") from None


@dataclass(frozen=True)
class GmmPlan:
    """The three products' configs for one (device, shape); hashable, so it can be a static jit argument."""

    fwd: ProductConfig
    dlhs: ProductConfig
    drhs: ProductConfig
    source: str = "default"

    def __post_init__(self):
        if self.drhs.kernel in ROWS_ONLY:
            raise GmmConfigError(f"drhs (the weight gradient) cannot run kernel={self.drhs.kernel!r}, which computes "
                                 f"the rows products only; choose one of "
                                 f"{', '.join(k for k in KERNELS if k not in ROWS_ONLY)}.")

    def product(self, name: str) -> ProductConfig:
        return getattr(self, name)


def _tile(bm, bn, bk, stages, persistent=True, minor=1, width=1) -> TileConfig:
    return TileConfig(bm, bn, bk, stages, persistent, minor, width)


# Used where the table has nothing that fits. The tile measured best for every product of every shape tuned
# on an H200 (see the data file); the 64-wide SAFE_PLAN takes dims that are only multiples of 64. Never
# tokamax's weight-gradient kernel: on an H200 (tokamax 0.0.17) its dW is wrong for groups of >= 512 rows.
_BEST = _tile(128, 128, 64, 4, True, 1, 4)
DEFAULT_PLAN = GmmPlan(fwd=ProductConfig("dropless", _BEST), dlhs=ProductConfig("dropless", _BEST),
                       drhs=ProductConfig("dropless", _BEST), source="default")
_SMALL = _tile(64, 64, 64, 4, True, 1, 4)
SAFE_PLAN = GmmPlan(fwd=ProductConfig("dropless", _SMALL), dlhs=ProductConfig("dropless", _SMALL),
                    drhs=ProductConfig("dropless", _SMALL), source="safe")


@dataclass(frozen=True)
class ShapeKey:
    """A grouped GEMM's static shape: M rows, K -> N features, G groups."""

    m: int
    k: int
    n: int
    g: int

    @property
    def rows_per_group(self) -> float:
        return self.m / self.g

    def distance(self, other: "ShapeKey") -> float:
        """How unlike two shapes are, for the nearest-entry fallback: feature dims matter most (they fix the
        tiles that divide), then rows per group (how much work each weight tile gets), then G."""
        log = lambda a, b: abs(math.log2(max(a, 1) / max(b, 1)))
        return (2 * (log(self.k, other.k) + log(self.n, other.n)) + log(self.rows_per_group, other.rows_per_group)
                + 0.5 * log(self.g, other.g))


def shape_class(m: int, k: int, n: int, g: int) -> str:
    """A readable name for a shape: features, groups and rows per group rounded to a power of two."""
    rows = max(1, round(m / g))
    return f"k{k}-n{n}-g{g}-r{2 ** round(math.log2(rows))}"


def device_kind() -> str | None:
    """`jax.devices()[0].device_kind` on a GPU (e.g. 'NVIDIA H200'), else None."""
    import jax  # here, so that the table code above stays pure Python

    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else None


def load_table(path: str | Path | None = None) -> dict[str, Any]:
    """The tuned-config table: the packaged configs.json, or `path`. Raises GmmConfigError if malformed."""
    if path is None:
        text = resources.files("dropless.gmm").joinpath(DATA_FILE).read_text()
        where = f"dropless/gmm/{DATA_FILE}"
    else:
        path = Path(path)
        if not path.exists():
            return empty_table()
        text, where = path.read_text(), str(path)
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        raise GmmConfigError(f"{where} is not valid JSON ({e}); fix it or delete it to start a new table.") from None
    validate_table(table, where)
    return table


def empty_table() -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "devices": {}, "aliases": {}}


def validate_table(table: Any, where: str = "table") -> None:
    """Check the schema; every entry must parse into a GmmPlan."""
    if not isinstance(table, dict) or table.get("schema_version") != SCHEMA_VERSION:
        raise GmmConfigError(f"{where} must be an object with schema_version {SCHEMA_VERSION}; "
                             "regenerate it with 'dropless tune-gmm'.")
    devices, aliases = table.get("devices"), table.get("aliases", {})
    if not isinstance(devices, dict) or not isinstance(aliases, dict):
        raise GmmConfigError(f"{where}: 'devices' and 'aliases' must be objects keyed by device kind.")
    for kind, entries in devices.items():
        if not isinstance(entries, list):
            raise GmmConfigError(f"{where}: devices[{kind!r}] must be a list of shape entries.")
        for i, entry in enumerate(entries):
            _entry_plan(entry, f"{where}: devices[{kind!r}][{i}]")
    for alias, target in aliases.items():
        if target not in devices:
            raise GmmConfigError(f"{where}: alias {alias!r} points to {target!r}, which has no table.")


def _entry_shape(entry: dict[str, Any], where: str) -> ShapeKey:
    try:
        return ShapeKey(*(int(entry[d]) for d in "mkng"))
    except (KeyError, TypeError, ValueError):
        raise GmmConfigError(f"{where} needs integer m, k, n and g.") from None


def _entry_plan(entry: Any, where: str) -> GmmPlan:
    if not isinstance(entry, dict):
        raise GmmConfigError(f"{where} must be an object.")
    shape = _entry_shape(entry, where)
    configs = {}
    for product in PRODUCTS:
        if product not in entry:
            raise GmmConfigError(f"{where} has no '{product}' config; every entry needs fwd, dlhs and drhs.")
        configs[product] = ProductConfig.from_json(entry[product], f"{where}.{product}")
    return GmmPlan(**configs, source=entry.get("name") or shape_class(shape.m, shape.k, shape.n, shape.g))


def resolve_device(table: dict[str, Any], kind: str | None) -> str | None:
    """The table key for a device kind: itself, its alias, or (for any Hopper part) the 'sm90' alias."""
    if kind is None:
        return None
    devices, aliases = table["devices"], table.get("aliases", {})
    if kind in devices:
        return kind
    if kind in aliases:
        return aliases[kind]
    if any(h in kind for h in ("H100", "H200", "H800", "H20", "GH200")) and "sm90" in aliases:
        return aliases["sm90"]
    return None


def lookup(table: dict[str, Any], kind: str | None, m: int, k: int, n: int, g: int) -> GmmPlan:
    """The plan for this shape on this device: the exact entry, else the nearest entry whose tiles divide
    this shape (per product), else DEFAULT_PLAN, else SAFE_PLAN."""
    shape = ShapeKey(m, k, n, g)
    device = resolve_device(table, kind)
    entries = table["devices"].get(device, []) if device else []
    ranked = sorted(entries, key=lambda e: _entry_shape(e, "entry").distance(shape))
    chosen: dict[str, ProductConfig] = {}
    sources = []
    for product in PRODUCTS:
        for entry in ranked:
            config = ProductConfig.from_json(entry[product])
            if config.fits(product, k, n):
                chosen[product] = config
                sources.append(entry.get("name") or shape_class(*(entry[d] for d in "mkng")))
                break
        else:
            for fallback in (DEFAULT_PLAN, SAFE_PLAN):
                if fallback.product(product).fits(product, k, n):
                    chosen[product] = fallback.product(product)
                    sources.append(fallback.source)
                    break
            else:
                raise GmmConfigError(f"no tile divides the grouped GEMM K={k}, N={n}; the Mosaic GPU kernels need "
                                     "K and N to be multiples of 64 (use moe.gmm_backend=xla for this shape).")
    return GmmPlan(**chosen, source="+".join(dict.fromkeys(sources)))


USER_TABLE_ENV = "DROPLESS_GMM_CONFIGS"
_TABLE_CACHE: dict[str, dict[str, Any]] = {}


def overlay(base: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    """`base` with every entry and alias of `user` added; user entries replace base entries of the same shape."""
    table = json.loads(json.dumps(base))
    table["aliases"] = {**table.get("aliases", {}), **user.get("aliases", {})}
    for kind, entries in user["devices"].items():
        for entry in entries:
            table = merge_entry(table, kind, entry)
    return table


def active_table(path: str | Path | None = None) -> dict[str, Any]:
    """The packaged table overlaid with `path`, or with the file named by $DROPLESS_GMM_CONFIGS (cached)."""
    path = path or os.environ.get(USER_TABLE_ENV) or None
    key = str(path or "")
    if key not in _TABLE_CACHE:
        table = load_table()
        if path is not None:
            if not Path(path).exists():
                raise GmmConfigError(f"tuned-config table {path} does not exist; run 'dropless tune-gmm --out {path}' "
                                     f"or unset {USER_TABLE_ENV}.")
            table = overlay(table, load_table(path))
        _TABLE_CACHE[key] = table
    return _TABLE_CACHE[key]


def plan_for(m: int, k: int, n: int, g: int, *, kind: str | None = None, path: str | Path | None = None) -> GmmPlan:
    """The plan for this shape on the current GPU (or `kind`): packaged table, overlaid by `path` or
    $DROPLESS_GMM_CONFIGS."""
    return lookup(active_table(path), kind if kind is not None else device_kind(), m, k, n, g)


def make_entry(name: str, shape: ShapeKey, configs: dict[str, ProductConfig], timings_ms: dict[str, float],
               provenance: str) -> dict[str, Any]:
    """One table entry as written by `dropless tune-gmm`."""
    entry: dict[str, Any] = {"name": name, "m": shape.m, "k": shape.k, "n": shape.n, "g": shape.g}
    for product in PRODUCTS:
        ms = timings_ms.get(product)
        entry[product] = configs[product].to_json() | ({"ms": round(float(ms), 4)} if ms is not None else {})
    entry["provenance"] = provenance
    entry["date"] = datetime.date.today().isoformat()
    return entry


def merge_entry(table: dict[str, Any], kind: str, entry: dict[str, Any]) -> dict[str, Any]:
    """A copy of `table` with `entry` added for `kind`, replacing any entry of the same shape."""
    table = json.loads(json.dumps(table))
    entries = table["devices"].setdefault(kind, [])
    shape = _entry_shape(entry, "new entry")
    entries[:] = [e for e in entries if _entry_shape(e, "entry") != shape] + [entry]
    entries.sort(key=lambda e: (e["k"], e["n"], e["g"], e["m"]))
    validate_table(table)
    return table


def save_table(table: dict[str, Any], path: str | Path) -> None:
    validate_table(table, str(path))
    # Whole or not at all: the packaged table is written in place by `dropless tune-gmm`, and a kill or a full
    # disk mid-write would leave every later kernel launch reading a torn file.
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # as the benchmarks' records: a new --out folder
    write_atomic(Path(path), json.dumps(table, indent=1, sort_keys=False) + "\n")
