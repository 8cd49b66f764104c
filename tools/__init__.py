"""The sparse-mlir command line."""
