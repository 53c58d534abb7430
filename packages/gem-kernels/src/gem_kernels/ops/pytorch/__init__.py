"""Exact PyTorch references (fp32 math) for every op; the Triton kernels are tested against these."""
