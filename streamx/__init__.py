"""streamx: stream selected layers hidden states into a Zarr store."""
__version__ = "0.1.0"
