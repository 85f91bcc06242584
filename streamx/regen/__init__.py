"""`streamx regenerate`: the target model writes the assistant turns its drafter will learn from. The turn plan
of each conversation, the engines that answer (OpenAI-compatible servers, or the model in this process), the
scheduler that keeps them busy, and the output file written exactly once.

    from streamx.regen import regenerate
    summary = regenerate(config)   # a RegenerateConfig
"""

from .runner import RegenerateSummary, regenerate

__all__ = ["RegenerateSummary", "regenerate"]
