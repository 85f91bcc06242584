"""How streamx knows the states it stores are the model's own: one proof at two moments.

    check    at start, on probe rows: each way of computing rows (packed, continued from a shared prefix, padded,
             a prefix row) against the model's own forward of each row alone; the run takes the fastest way proven
             (streamx.model.packing.configure, streamx.pipeline.plan)
    audit    while the run goes, on its own rows: rows of each way computed again alone and compared before their
             batch is written, within a share of the forward time; what a way found wrong is
    tolerance
             what a right way may differ by, for both: the dtype's floor, or in bf16 the model's own noise (measured
             at start-up: a row alone against the row among copies of itself)
    ladder   the ways a run computes rows, walked down when the audit finds one wrong, down to one row per forward
             (right by definition); the rows computed each way meanwhile, which streamx.pipeline.heal writes over

What each run proved goes into its store (store.format.Audited), read by `inspect` and `verify`.
"""
