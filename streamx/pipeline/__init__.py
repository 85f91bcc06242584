"""One run of `streamx run`: its plan (settings -> source -> model -> layout), the threads and bounded queues
between the stages (runner), the writer stage, the ranks under torchrun, what it measures, and the size plan
of `streamx plan` (estimate).

    from streamx.pipeline import run
    summary = run(config)          # a RunConfig (streamx.config.load_config)
"""

from .runner import RunSummary, run

__all__ = ["RunSummary", "run"]
