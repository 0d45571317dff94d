"""FP8 training (`train.fp8`): the recipes, the dense layers' FP8 matmul and the FP8 grouped GEMM."""

from dropless.fp8.dense import fp8_matmul, linear
from dropless.fp8.grouped import Fp8Gmm, experts_gmm
from dropless.fp8.recipe import Recipe, make_recipe, train_recipe

__all__ = ["Fp8Gmm", "experts_gmm", "Recipe", "fp8_matmul", "linear", "make_recipe", "train_recipe"]
