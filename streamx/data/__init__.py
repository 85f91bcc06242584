"""Rows in: the source (files, datasets, the embedded corpus), messages, tokenization (chat template -> ids
+ loss mask) and batching (packed or padded batches under the token budget)."""
