"""From the store to a drafter: `convert` (the folder speculators trains from), the speculators backend that
reads the store itself, a torch Dataset over a store for any trainer, and `verify` (a store checked before a
long training run)."""
