"""A diagnostic lowering of the blockwise kernels' promotion: each K block's fresh accumulator left unwritten and
its first wgmma issued with scale-d off (D = A·B instead of D = 0 + A·B), as DeepGEMM issues it.

Pallas allocates a WGMMA accumulator (`plgpu.ACC` in `pl.run_scoped`) as a zero splat behind an optimization
barrier, which Mosaic GPU lowers to one register move per float32 of the tile (64 per consumer thread per
128-column slice), and every wgmma has scale-d on. The blockwise kernels allocate a fresh accumulator for every
128-wide K block (`fp8_mosaic._promote`), so each block pays those moves in the consumers' issue slots beside the
promotion's multiply-adds. Inside `scale_d_off()` such a barrier yields undefined registers instead, and the first
instruction of a wgmma whose accumulator is exactly those registers has scale-d off: the same bits, no moves. The
patch swaps one lowering rule of `jax.experimental.mosaic.gpu.dialect_lowering` and one function of its `wgmma`
module while a kernel is lowered; the benchmark compiles a kernel inside it once and times the executable outside.
Only an accumulator whose every use is a wgmma's accumulator operand is changed, as `_promote`'s are; one carried
by a loop (the rowwise kernels', the bf16 kernels') keeps its zeros.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect

import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm

# The modules, not the functions of the same names that jax.experimental.mosaic.gpu exports.
_wg = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")
_dl = importlib.import_module("jax.experimental.mosaic.gpu.dialect_lowering")
_BARRIER = "mosaic_gpu.optimization_barrier"
_UNDEFINED: set = set()  # registers of accumulators allocated under the patch


def _scale_d_m64():
    """wgmma_m64 with a `first_use_out` argument: the scale-d immediate of its first instruction."""
    src = inspect.getsource(_wg.wgmma_m64)
    edits = [("def wgmma_m64(", "def _wgmma_m64_scale_d("),
             ("    b_element_type: ir.Type,\n):", "    b_element_type: ir.Type,\n    first_use_out: int = 1,\n):"),
             ("[*acc_regs, *a_args, b_descriptor, *imms]",
              "[*acc_regs, *a_args, b_descriptor, *([lc(first_use_out), *imms[1:]] if i == 0 else imms)]")]
    for old, new in edits:
        if src.count(old) != 1:
            raise RuntimeError(f"jax.experimental.mosaic.gpu.wgmma.wgmma_m64 changed: {old!r} not found once")
        src = src.replace(old, new)
    namespace = dict(vars(_wg))
    exec(compile(src, _wg.__file__, "exec"), namespace)  # noqa: S102 - a diagnostic lowering, see the docstring
    return namespace["_wgmma_m64_scale_d"]


def _owner(value):
    owner = value.owner
    return owner if isinstance(owner, ir.Operation) or hasattr(owner, "operation") else None


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
    """Every use of value is as a wgmma's accumulator, so no instruction reads it except one that may ignore it
    (an accumulator carried by a loop, as the rowwise kernels' is, is read by the loop)."""
    uses = list(value.uses)
    return bool(uses) and all(u.owner.name == "mosaic_gpu.wgmma" and u.operand_number == 0 for u in uses)


def _fresh(reg) -> bool:
    """A register of an accumulator allocated under the patch, or one lane slice of such a register (the
    accumulator's 32-bit layout splits each register)."""
    if reg in _UNDEFINED:
        return True
    op = _owner(reg)
    return op is not None and op.name == "vector.extract_strided_slice" and op.operands[0] in _UNDEFINED


@contextlib.contextmanager
def scale_d_off():
    """While active, zero accumulators behind an optimization barrier are undefined registers, and the first
    wgmma instruction into one has scale-d off."""
    original_barrier, original_m64 = _dl._lowerings[_BARRIER], _wg.wgmma_m64
    m64 = _scale_d_m64()

    def barrier(ctx, op):
        operands = list(op.operands)
        if len(operands) == 1 and isinstance(operands[0].type, ir.VectorType) and \
                isinstance(operands[0].type.element_type, ir.F32Type) and _only_accumulates(op.results[0]):
            [layout] = _dl.inference_utils.in_layouts(op)
            arr = _dl._fragmented_array_from_ir(operands[0], layout)
            if all(_is_zero(r) for r in arr.registers.flat):
                regs = np.array([llvm.mlir_undef(r.type) for r in arr.registers.flat], dtype=object)
                _UNDEFINED.update(regs)
                undefined = _dl.fa.FragmentedArray(_registers=regs.reshape(arr.registers.shape), _layout=arr.layout,
                                                   _is_signed=arr.is_signed)
                return [_dl.fragmented_array_to_ir(undefined, op.results[0].type)]
        return original_barrier(ctx, op)

    def wgmma_m64(acc, *args, **kwargs):
        return m64(acc, *args, first_use_out=0 if all(_fresh(r) for r in acc.flat) else 1, **kwargs)

    _dl._lowerings[_BARRIER] = barrier
    _wg.wgmma_m64 = wgmma_m64
    try:
        yield
    finally:
        _dl._lowerings[_BARRIER] = original_barrier
        _wg.wgmma_m64 = original_m64
        _UNDEFINED.clear()
