"""``sparse_mlir.dask``: the Dask integration under the name the issue asked for (``sparse_mlir.distributed``)."""

from sparse_mlir.distributed import *  # noqa: F401,F403
from sparse_mlir.distributed import __all__  # noqa: F401
