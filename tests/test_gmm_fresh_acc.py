"""dropless.gmm.fresh_acc: the blockwise kernels' per-block accumulators lowered without their zero fill, each
block's first wgmma with scale-d off. The kernels are lowered for CUDA on this CPU and every rewritten instruction
is read back from the lowering; the GPU's bits are checked by `make bench-fp8-fresh-acc`."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from dropless.gmm import fp8_mosaic, fresh_acc
from dropless.gmm.dropless_mosaic import ragged_rows
from dropless.gmm.tuning import ProductConfig, TileConfig
from tests.test_gmm_fp8_kernels import _lower

WGMMA_CHAIN = 4  # e4m3 wgmma instructions per 128-wide K block (k = 32 each)


def _scale_d(asm, outputs: int) -> int:
    """The scale-d immediate of one lowered wgmma instruction with `outputs` accumulator registers."""
    index = int(fresh_acc._SCALE_D.search(fresh_acc._text(asm)).group(1)) - outputs
    return fresh_acc._owner(asm.operands[index]).attributes["value"].value


def _chain(first):
    """first and the wgmma instructions that take its accumulator after it, in order."""
    chain = [first]
    while len(chain) < WGMMA_CHAIN:
        extract = next(iter(chain[-1].results[0].uses)).owner
        nxt = [u.owner for u in extract.results[0].uses
               if u.owner.name == "llvm.inline_asm" and "wgmma.mma_async" in fresh_acc._text(u.owner)]
        if not nxt:
            break
        chain.append(nxt[0])
    return chain


@pytest.fixture
def rewritten(monkeypatch):
    """The rewritten instructions' scale-d values along each block's chain, for every lowering in the test."""
    chains = []
    original = fresh_acc._scale_d_off

    def spy(asm, outputs):
        original(asm, outputs)
        chains.append([_scale_d(a, outputs) for a in _chain(asm)])

    monkeypatch.setattr(fresh_acc, "_scale_d_off", spy)
    return chains


def _lower_default(product, scaling):
    tile = fp8_mosaic.default_tile(product, 8192, 7168, 4096, 32, scaling)
    out = jnp.float32 if product == "drhs" else jnp.bfloat16
    return _lower(product, scaling, tile, 8192, 7168, 4096, 32, out, fp8_mosaic.default_stack(product, scaling),
                  fp8_mosaic.default_stream(product, scaling)).mlir_module()


def test_this_jax_lowers_as_the_rewrite_expects():
    assert fresh_acc.available() and fresh_acc.install()


@pytest.mark.parametrize("product, slices", [("fwd", 2), ("dlhs", 2), ("drhs", 1)])
def test_each_blockwise_accumulator_slice_starts_with_scale_d_off(product, slices, rewritten, monkeypatch):
    """One rewrite per 128-column accumulator slice of the block (the 64x256 consumers have two), whose first
    instruction ignores the accumulator and whose next three add to it; the kernel's program changes."""
    monkeypatch.setattr(fresh_acc, "ENABLED", False)
    zero_filled = _lower_default(product, "blockwise")
    assert rewritten == []
    monkeypatch.setattr(fresh_acc, "ENABLED", True)
    fresh = _lower_default(product, "blockwise")
    assert rewritten == [[0, 1, 1, 1]] * slices
    assert fresh != zero_filled


@pytest.mark.parametrize("product", ["fwd", "drhs"])
def test_rowwise_accumulators_carried_by_the_loop_keep_their_zeros(product, rewritten, monkeypatch):
    """Rowwise scaling accumulates every K step into one accumulator carried by the pipeline's loop: it is read
    before the first wgmma of each step, so it keeps its zero fill and scale-d stays on."""
    texts = []
    for enabled in (False, True):
        monkeypatch.setattr(fresh_acc, "ENABLED", enabled)
        texts.append(_lower_default(product, "rowwise"))
    assert rewritten == [] and texts[0] == texts[1]


def test_other_kernels_are_not_rewritten(rewritten, monkeypatch):
    """Only modules named dropless_fp8_gmm_*: the bf16 grouped GEMM lowers the same either way."""
    config = ProductConfig("dropless_ws", TileConfig(128, 128, 64, 3))
    S = jax.ShapeDtypeStruct
    texts = []
    for enabled in (False, True):
        monkeypatch.setattr(fresh_acc, "ENABLED", enabled)
        fn = jax.jit(lambda a, b, gs: ragged_rows(a, b, gs, config, transpose_rhs=False, out_dtype=jnp.bfloat16))
        texts.append(export.export(fn, platforms=["cuda"])(
            S((8192, 1024), jnp.bfloat16), S((8, 1024, 2048), jnp.bfloat16), S((8,), jnp.int32)).mlir_module())
    assert rewritten == [] and texts[0] == texts[1]


def test_an_instruction_not_laid_out_as_expected_is_refused():
    """An undefined accumulator must never be added to: where the predicate is missing, the lowering fails."""
    class Attr:
        value = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {$0}, $1, $2, 1, 1, 1;"

    class Asm:
        attributes = {"asm_string": Attr()}

    with pytest.raises(RuntimeError, match="scale-d predicate"):
        fresh_acc._scale_d_off(Asm(), outputs=64)


def test_the_predicate_pattern_matches_what_wgmma_m64_writes():
    text = "{ .reg .pred p; setp.ne.b32 p, $130, 0; wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 ... }"
    assert re.search(fresh_acc._SCALE_D, text).group(1) == "130"
