"""Triton kernels for streamx (imported as streamx_kernels)."""
