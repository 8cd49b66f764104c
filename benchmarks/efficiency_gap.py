"""Run the efficiency-gap benchmark (same as ``sparse-mlir bench``): see sparse_mlir/tools/bench.py.

    python benchmarks/efficiency_gap.py [--quick] [--check] [--out DIR]
"""

import runpy
import sys

if __name__ == "__main__":
    sys.argv[0] = "sparse-mlir bench"
    runpy.run_module("sparse_mlir.tools.bench", run_name="__main__")
