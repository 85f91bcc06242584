"""Measurement: `streamx bench` (the pipeline against the plain forward pass and a naive dumper), the writer
bench, and the machine's ceilings (matmul peak, host copy, plain writes)."""
