"""The model stage: loading the model, hooks on the selected layers (capture), the real tokens gathered into
the states buffer (gather, with kernels/ as its Triton twin), packed batches that keep samples apart
(packing), and the copy to the host (transfer)."""
