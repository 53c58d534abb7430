"""Triton kernels with torch.autograd.Function wrappers. Importing this package imports triton."""
