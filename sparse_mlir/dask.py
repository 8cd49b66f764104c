"""``sparse_mlir.dask``: the Dask integration under the name the issue asked for (``sparse_mlir.distributed``)."""

from .distributed import *  # noqa: F401,F403
from .distributed import __all__  # noqa: F401
