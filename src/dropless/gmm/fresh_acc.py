"""Fresh WGMMA accumulators without the zero fill, for the blockwise e4m3 kernels' promotion.

Blockwise promotion (fp8_mosaic._promote) runs each 128-wide K block's wgmma into a fresh float32 accumulator.
Pallas allocates one (`plgpu.ACC` in `pl.run_scoped`) as a zero splat behind an optimization barrier, which
lowers to one register move per element, 64 per consumer thread per 128-column slice and block, in the same
issue slots as the promotion's multiply-adds; and Mosaic GPU issues every wgmma with scale-d on (D = D + A·B).
Hopper's wgmma can ignore D instead (scale-d off: D = A·B), as DeepGEMM issues each block's first MMA.

`install()` wraps two steps of Mosaic GPU's lowering, which then rewrite, while `ENABLED` and for kernels whose
module is named `dropless_fp8_gmm_*` only:
- a zero splat behind an optimization barrier whose every use is a wgmma's accumulator operand lowers to undefined
  registers (an accumulator carried by a loop, as the rowwise and bf16 kernels' are, keeps its zeros);
- a wgmma whose accumulator registers are all undefined has its first instruction's scale-d off. Any undefined
  accumulator may take this rewrite: D = A·B is one value of "undefined + A·B".
The result is the same bits with fewer instructions. `available()` says whether this JAX's Mosaic GPU lowers as
the rewrite expects; where it does not, the kernels keep the zero fill.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re

import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm

# The modules, not the functions of the same names that jax.experimental.mosaic.gpu exports.
_wgmma = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")
_lowering = importlib.import_module("jax.experimental.mosaic.gpu.dialect_lowering")
_BARRIER = "mosaic_gpu.optimization_barrier"
_WGMMA = "mosaic_gpu.wgmma"
MODULE_PREFIX = "dropless_fp8_gmm_"
# Read when a kernel is lowered. Off: `make bench-fp8-fresh-acc`, which lowers every kernel both ways, measures the
# same bits and no product or step faster with it on an H200 (BENCHMARKS.md).
ENABLED = False
# The predicate wgmma_m64 builds from its first immediate operand: `setp.ne.b32 p, $<operand>, 0`.
_SCALE_D = re.compile(r"setp\.ne\.b32 p, \$(\d+), 0;\s*wgmma\.mma_async")


@functools.cache
def available() -> bool:
    """Whether this JAX lowers as the rewrite expects: the barrier rule registered, and wgmma_m64 building each
    instruction's scale-d predicate from an immediate that is 1."""
    if _BARRIER not in getattr(_lowering, "_lowerings", {}) or not hasattr(_wgmma, "wgmma_m64"):
        return False
    src = inspect.getsource(_wgmma.wgmma_m64)
    return "setp.ne.b32 p, {use_out_reg}, 0;" in src and "use_out = scale_a = scale_b = lc(1)" in src


def _owner(value):
    owner = value.owner
    return owner if isinstance(owner, ir.Operation) else getattr(owner, "operation", None)


def _in_our_kernel(op) -> bool:
    parent = op.operation.parent
    while parent is not None:
        if parent.name == "builtin.module" and "sym_name" in parent.attributes:
            return ir.StringAttr(parent.attributes["sym_name"]).value.startswith(MODULE_PREFIX)
        parent = parent.parent
    return False


def _is_zero(value) -> bool:
    """value is arith.constant 0.0, or a vector.broadcast of one."""
    op = _owner(value)
    if op is not None and op.name == "vector.broadcast":
        op = _owner(op.operands[0])
    if op is None or op.name != "arith.constant":
        return False
    attr = op.attributes["value"]
    if isinstance(attr, ir.FloatAttr):
        return attr.value == 0.0
    return isinstance(attr, ir.DenseFPElementsAttr) and attr.is_splat and attr.get_splat_value().value == 0.0


def _only_accumulates(value) -> bool:
    uses = list(value.uses)
    return bool(uses) and all(u.owner.name == _WGMMA and u.operand_number == 0 for u in uses)


def _undefined(reg) -> bool:
    """reg is undefined, or a slice of an undefined vector (the accumulator's 32-bit layout splits registers)."""
    op = _owner(reg)
    if op is not None and op.name == "vector.extract_strided_slice":
        op = _owner(op.operands[0])
    return op is not None and op.name == "llvm.mlir.undef"


def _barrier_rule(original):
    def rule(ctx, op):
        operands = list(op.operands)
        if (ENABLED and len(operands) == 1 and isinstance(operands[0].type, ir.VectorType)
                and isinstance(operands[0].type.element_type, ir.F32Type)
                and _only_accumulates(op.results[0]) and _in_our_kernel(op)):
            [layout] = _lowering.inference_utils.in_layouts(op)
            arr = _lowering._fragmented_array_from_ir(operands[0], layout)
            if all(_is_zero(r) for r in arr.registers.flat):
                regs = np.array([llvm.mlir_undef(r.type) for r in arr.registers.flat], dtype=object)
                undefined = _lowering.fa.FragmentedArray(
                    _registers=regs.reshape(arr.registers.shape), _layout=arr.layout, _is_signed=arr.is_signed)
                return [_lowering.fragmented_array_to_ir(undefined, op.results[0].type)]
        return original(ctx, op)

    rule._dropless_fresh_acc = True
    return rule


def _first_instruction(result_reg):
    """The first wgmma instruction of the chain whose last one produced result_reg (each instruction's
    accumulator inputs are the previous one's outputs)."""
    asm = _owner(_owner(result_reg).operands[0])
    while True:
        prev = _owner(asm.operands[0])
        prev_asm = _owner(prev.operands[0]) if prev is not None and prev.name == "llvm.extractvalue" else None
        if prev_asm is None or prev_asm.name != "llvm.inline_asm":
            return asm
        asm = prev_asm


def _text(asm) -> str:
    attr = asm.attributes["asm_string"]
    return attr.value if hasattr(attr, "value") else ir.StringAttr(attr).value


def _scale_d_off(asm, outputs: int) -> None:
    """Set the instruction's scale-d immediate to 0; raise where the instruction is not laid out as expected (an
    undefined accumulator must never be added to)."""
    found = _SCALE_D.search(_text(asm))
    if found is None:
        raise RuntimeError("fresh_acc: a wgmma instruction without the expected scale-d predicate")
    index = int(found.group(1)) - outputs  # the asm's $n count its outputs first, then its operands
    current = _owner(asm.operands[index])
    if current is None or current.name != "llvm.mlir.constant" or current.attributes["value"].value != 1:
        raise RuntimeError("fresh_acc: a wgmma instruction's scale-d operand is not the constant 1")
    i32 = ir.IntegerType.get_signless(32)
    with ir.InsertionPoint(asm):
        zero = llvm.ConstantOp(i32, ir.IntegerAttr.get(i32, 0))
    asm.operands[index] = zero.result


def _wgmma_m64(original):
    def wgmma_m64(acc, *args, **kwargs):
        fresh = all(_undefined(r) for r in acc.flat)
        out = original(acc, *args, **kwargs)
        if fresh:
            _scale_d_off(_first_instruction(out.flat[0]), outputs=len(acc.flat))
        return out

    return wgmma_m64


def install() -> bool:
    """Wrap the two lowering steps once per process (where available()); whether the rewrite is in place."""
    if not available():
        return False
    rules = _lowering._lowerings
    if not getattr(rules[_BARRIER], "_dropless_fresh_acc", False):
        rules[_BARRIER] = _barrier_rule(rules[_BARRIER])
        _wgmma.wgmma_m64 = _wgmma_m64(_wgmma.wgmma_m64)
    return True
