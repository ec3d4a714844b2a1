"""difftest: cross-backend differential testing of sparse paged-attention decode kernels."""

__version__ = "0.1.0"
