"""Ahead-of-time exports: object file, shared library, C header, PTX/cubin, CUDA launcher and manifest."""
