"""Parameters declared once: each module states its weights as `ParamSpec`s, and everything else derives from them.

A module's declaration is a function of the config returning a nested dict of `ParamSpec(shape, axes, init)`
(e.g. `dropless.moe.layer.moe_params`); stacked layers add a leading `layers` axis (`stacked`). From the
declaration come the initial values (`init`, `init_one_draw`), the logical axes that the sharding rules of
`dropless.core.mesh` read (`logical_axes`), the abstract shapes (`shapes`), the shape checks at a layer's
boundary (`flatten`), the shardings (`shardings`) and the documented layout (`table`).

An entry may be `None`: an optional weight that is absent under this config but keeps its place in the key
order, so switching it on or off leaves the other weights' initial values as they are.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Literal, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from dropless.core.mesh import LOGICAL_AXIS_RULES, logical_to_spec


@dataclass(frozen=True)
class ParamSpec:
    """One float32 weight: its shape, the logical axis of each dimension, and its initial value
    ("normal": normal(0, init_std); "ones": a norm's scale)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: Literal["normal", "ones"] = "normal"

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), f"{self.shape} needs one logical axis per dimension: {self.axes}"
        assert all(a is None or a in LOGICAL_AXIS_RULES for a in self.axes), f"unknown logical axis in {self.axes}"
        assert self.init in ("normal", "ones"), self.init


Specs = dict[str, Union[ParamSpec, "Specs", None]]


def stacked(specs: Specs, count: int, axis: str = "layers") -> Specs:
    """The same weights for `count` layers, each on a new leading `axis`."""
    def stack(spec):
        if spec is None:
            return None
        if isinstance(spec, ParamSpec):
            return replace(spec, shape=(count, *spec.shape), axes=(axis, *spec.axes))
        return stacked(spec, count, axis)

    return {name: stack(spec) for name, spec in specs.items()}


def present(specs: Specs) -> dict:
    """The declaration without its absent (`None`) entries: a pytree shaped like the parameters."""
    return {name: spec if isinstance(spec, ParamSpec) else present(spec)
            for name, spec in specs.items() if spec is not None}


def flatten(specs: Specs, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], ParamSpec]]:
    """(path, spec) of every present weight, in declaration order."""
    out = []
    for name, spec in specs.items():
        if isinstance(spec, ParamSpec):
            out.append(((*prefix, name), spec))
        elif spec is not None:
            out.extend(flatten(spec, (*prefix, name)))
    return out


def _map(fn, specs: Specs) -> Any:
    return jax.tree.map(fn, present(specs), is_leaf=lambda node: isinstance(node, ParamSpec))


def logical_axes(specs: Specs) -> Any:
    """A pytree shaped like the parameters whose leaves are tuples of logical axis names."""
    return _map(lambda spec: spec.axes, specs)


def shapes(specs: Specs) -> Any:
    """A pytree of float32 `jax.ShapeDtypeStruct`s shaped like the parameters."""
    return _map(lambda spec: jax.ShapeDtypeStruct(tuple(map(int, spec.shape)), jnp.float32), specs)


def shardings(mesh: Mesh, specs: Specs) -> Any:
    """A pytree of `NamedSharding`s shaped like the parameters, from the declaration alone (nothing traced): the
    rules of `dropless.core.mesh`, a mesh axis that does not divide a dimension leaving it replicated."""
    return _map(lambda spec: NamedSharding(mesh, logical_to_spec(mesh, spec.axes, tuple(map(int, spec.shape)))),
                specs)


def _draws(entry) -> bool:
    return not (isinstance(entry, ParamSpec) and entry.init == "ones")


def init(key: jax.Array, specs: Specs, init_std: float) -> dict:
    """Float32 values, each weight drawn from its own key.

    A dict's key is split into one key per entry that draws (a "normal" weight, a sub-dict, or an absent
    optional weight), in declaration order; "ones" weights take none, and a dict with a single such entry
    hands its key on unsplit.
    """
    drawing = [name for name, entry in specs.items() if _draws(entry)]
    keys = dict(zip(drawing, [key] if len(drawing) == 1 else jax.random.split(key, len(drawing))))
    out = {}
    for name, entry in specs.items():
        if entry is None:
            continue
        if not isinstance(entry, ParamSpec):
            out[name] = init(keys[name], entry, init_std)
        elif entry.init == "ones":
            out[name] = jnp.ones(entry.shape, jnp.float32)
        else:
            out[name] = init_std * jax.random.normal(keys[name], entry.shape, jnp.float32)
    return out


def init_one_draw(key: jax.Array, specs: Specs, init_std: float) -> dict:
    """Float32 values whose "normal" weights are consecutive slices, in pytree order, of ONE normal draw.

    XLA then compiles one random-number kernel instead of one per weight, which makes compiling a whole model's
    initialisation several times faster on a CPU.
    """
    leaves, treedef = jax.tree.flatten(present(specs), is_leaf=lambda node: isinstance(node, ParamSpec))
    total = sum(math.prod(spec.shape) for spec in leaves if spec.init == "normal")
    draw = init_std * jax.random.normal(key, (total,), jnp.float32)
    values, offset = [], 0
    for spec in leaves:
        if spec.init == "ones":
            values.append(jnp.ones(spec.shape, jnp.float32))
            continue
        count = math.prod(spec.shape)
        values.append(draw[offset:offset + count].reshape(spec.shape))
        offset += count
    return jax.tree.unflatten(treedef, values)


class Dim(int):
    """A size that remembers its formula: declared with a config whose sizes are `Dim`s (`symbolic`), every shape
    prints as the documentation writes it, e.g. [L, E, D, 2*F]."""

    def __new__(cls, value: int, formula: str, compound: bool = False):
        dim = super().__new__(cls, value)
        dim.formula, dim.compound = formula, compound
        return dim

    def __str__(self) -> str:
        return self.formula

    def _term(self, other, in_product: bool) -> str:
        text = str(other)
        return f"({text})" if in_product and getattr(other, "compound", False) else text

    def _combine(self, other, symbol: str, reverse: bool) -> "Dim":
        if not isinstance(other, int):  # a string repeated (`"D" * layers`) or a float: Python's own operation
            return NotImplemented
        product = symbol == "*"
        left, right = (other, self) if reverse else (self, other)
        value = {"+": operator.add, "-": operator.sub, "*": operator.mul}[symbol](int(left), int(right))
        return Dim(value, f"{self._term(left, product)}{symbol}{self._term(right, product)}", compound=not product)

    def __add__(self, other):
        return self._combine(other, "+", False)

    def __radd__(self, other):
        return self._combine(other, "+", True)

    def __sub__(self, other):
        return self._combine(other, "-", False)

    def __mul__(self, other):
        return self._combine(other, "*", False)

    def __rmul__(self, other):
        return self._combine(other, "*", True)


def symbolic(values: Any, names: dict[str, str]) -> Any:
    """A copy of a config dataclass whose int fields listed in `names` are `Dim`s of those names."""
    return replace(values, **{key: Dim(getattr(values, key), name) for key, name in names.items()})


def table(specs: Specs) -> str:
    """The layout as a Markdown table: one row per weight with its shape, logical axes and initial value."""
    rows = ["| parameter | shape | logical axes | init |", "|---|---|---|---|"]
    for path, spec in flatten(specs):
        shape = ", ".join(map(str, spec.shape))
        axes = ", ".join("-" if axis is None else axis for axis in spec.axes)
        rows.append(f"| `{'.'.join(path)}` | [{shape}] | ({axes}) | {spec.init} |")
    return "\n".join(rows) + "\n"
