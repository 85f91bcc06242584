"""The draft's mask token, where `speculators train` cannot resolve it itself.

speculators 0.9.0 resolves a mask token id for every draft but MTP (DFlash fills its blocks with it; EAGLE-3 is
built with it and never reads it) from the verifier's tokenizer, which it loads through AutoProcessor
(speculators.train.utils.resolve_mask_token_id). For a multimodal verifier AutoProcessor builds the model's processor,
which reads the image and video processors' files: a checkpoint saved without them fails before training (`OSError:
Can't load image processor`). There the train commands pass --mask-token-id with the id speculators would have
picked from the same tokenizer, so the draft is the one it would have built.
"""

from __future__ import annotations

from transformers import AutoConfig
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
from transformers.utils import FEATURE_EXTRACTOR_NAME, PROCESSOR_NAME, VIDEO_PROCESSOR_NAME, cached_file

from ..model.load import load_tokenizer, read_text_config

MASK_TOKEN = "<|MASK|>"  # what speculators adds to a tokenizer that leaves embedding rows unused
PROCESSOR_FILES = (PROCESSOR_NAME, FEATURE_EXTRACTOR_NAME, VIDEO_PROCESSOR_NAME)  # what AutoProcessor looks for


def lacks_processor(verifier: str) -> bool:
    """AutoProcessor would build the verifier's own (multimodal) processor, and none of its files is there. False
    where the verifier's config cannot be read here: `verify --speculators`, where the drafts train, tells then."""
    try:
        model_type = AutoConfig.from_pretrained(verifier).model_type
    except (OSError, ValueError):
        return False
    return model_type in PROCESSOR_MAPPING_NAMES and not any(
        cached_file(verifier, name, _raise_exceptions_for_missing_entries=False,
                    _raise_exceptions_for_connection_errors=False) for name in PROCESSOR_FILES)


def mask_token_id(verifier: str) -> int:
    """The id speculators picks from the verifier's tokenizer: its mask token, else the MASK_TOKEN it adds where
    the embedding has rows the tokenizer does not use, else the pad, eos or unk token."""
    tokenizer = load_tokenizer(verifier)
    if tokenizer.mask_token_id is None and len(tokenizer) < read_text_config(verifier).vocab_size:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})  # the id it gets, as in speculators
    for token_id in (tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if token_id is not None:
            return token_id
    raise ValueError(f"{verifier}'s tokenizer has no mask, pad, eos or unk token and no unused embedding row: give "
                     "speculators train --mask-token-id N, a token id the data does not hold")
