"""dropless.gmm: grouped GEMMs (ragged rows x one weight per group) behind one interface."""

from dropless.gmm.api import CapacityGmm, GroupedMatmul, XlaGmm, make_gmm, row_mask

__all__ = ["CapacityGmm", "GroupedMatmul", "XlaGmm", "make_gmm", "row_mask"]
