"""Triton kernels for streamx. Kept in kernels/streamx_kernels/, never as a package named `kernels`: that
would shadow the PyPI package of the name, which transformers imports, whenever Python runs in the checkout."""
