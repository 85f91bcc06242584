"""`python -m streamx ARGS` in each process of a torchrun job, with a fault the start-up check cannot see injected
in every process (tests/test_tensor_parallel.py): with AFTER set, packed batches of more segments than the probes'
get a rope off by two from the AFTER-th such batch on (helpers.broken_packed_batch); with KILL_HEAL set, the first
process fails where it would compute again the rows it committed the broken way."""

import os
import runpy

from helpers import broken_packed_batch

from streamx.data import batching
from streamx.pipeline import runner

if "AFTER" in os.environ:
    batching.packed_batch = broken_packed_batch(int(os.environ["AFTER"]))
if os.environ.get("KILL_HEAL"):
    def killed(*args, **kwargs):
        raise RuntimeError("killed before healing")

    runner.heal = killed
runpy.run_module("streamx", run_name="__main__")
