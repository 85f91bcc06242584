"""streamx: stream selected layers hidden states into a Zarr store."""
__version__ = "0.8.2"

from .store import open_store  # noqa: E402  - the read API: open_store(path).sample(row_id)

__all__ = ["open_store", "__version__"]
