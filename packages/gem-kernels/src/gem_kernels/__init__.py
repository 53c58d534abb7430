"""gem-kernels."""
