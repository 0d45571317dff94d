"""dropless.gmm: grouped GEMMs (ragged rows x one weight per group) behind one interface.

api.py: the interface and row contract; registry.py: the backends by `moe.gmm_backend` name; vjp.py: the one
custom VJP over three products; xla.py, capacity.py, tokamax.py, dropless_mosaic.py: the backends; mosaic.py,
mosaic_ws.py: our Mosaic GPU kernels; tuning.py + configs.json: their tiles, as data keyed by device and shape.
"""

from dropless.gmm.api import GroupedMatmul, row_mask
from dropless.gmm.capacity import CapacityGmm
from dropless.gmm.dropless_mosaic import DroplessMosaicGmm
from dropless.gmm.registry import make_gmm, resolve_backend_name
from dropless.gmm.tokamax import TokamaxGmm
from dropless.gmm.vjp import GmmProducts, gmm_from_products
from dropless.gmm.xla import XlaGmm

__all__ = ["CapacityGmm", "DroplessMosaicGmm", "GmmProducts", "GroupedMatmul", "TokamaxGmm", "XlaGmm",
           "gmm_from_products", "make_gmm", "resolve_backend_name", "row_mask"]
