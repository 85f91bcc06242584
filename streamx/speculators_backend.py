"""`python -m streamx.speculators_backend`: speculators' own train CLI with the `streamx` hidden-states backend
registered (streamx.train.backend), the name every convert folder's saved commands use. Importing it registers
the backend."""

from .train.backend import StoreTransfer, StreamxBackend, main

__all__ = ["StoreTransfer", "StreamxBackend", "main"]

if __name__ == "__main__":
    main()
