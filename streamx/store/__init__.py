"""The store: what a store is (`format`, with the fp8 encoding in `fp8`), how a shard file is laid out and
filled (`shards`), and how to read one (`reader`); beside them, how a run opens a store and owns its part
(`prepare`), and the free-space guard (`space`). docs/store.md describes the format.

    import streamx
    store = streamx.open_store("out.zarr")
    store.sample(row_id).hidden_states      # bf16 [T, K, H]
"""

from .format import (
    BF16,
    FP8_STORAGE,
    PARTS,
    STORAGES,
    Audited,
    Commit,
    Compat,
    Layout,
    SharedKinds,
    Storage,
    StoreError,
    StoreMetadata,
    bf16_to_bits,
    create_part,
    make_layout,
    storage_named,
)
from .prepare import Output, OwnedPart, RunStore, check_compatible, open_for_run, prepare
from .reader import Completeness, DoneKeys, RowSet, SampleIndex, Store, StoredSample, open_store, to_json
from .space import SpaceGuard, free_bytes

__all__ = [
    "BF16", "FP8_STORAGE", "PARTS", "STORAGES", "Audited", "Commit", "Compat", "Completeness", "DoneKeys", "Layout",
    "Output", "OwnedPart", "RowSet", "RunStore", "SampleIndex", "SharedKinds", "SpaceGuard", "Storage", "Store",
    "StoreError", "StoreMetadata", "StoredSample", "bf16_to_bits", "check_compatible", "create_part", "free_bytes",
    "make_layout", "open_for_run", "open_store", "prepare", "storage_named", "to_json",
]
