"""The bad-input errors, free of imports so the CLI can catch them without loading jax.

Every error meaning "the input is wrong" (a config, data file, checkpoint, HF directory or eval set) derives
from `BadInput`: a command ends on it with exit status 2 and its one-line message, never a traceback.
"""


class BadInput(ValueError):
    """Input that cannot be used; the message names the file, field or value and the fix."""


class InteropError(BadInput):
    """Input that cannot be converted or compared; the message names the file, field or tensors."""


EXIT_STORAGE_UNAVAILABLE = 69  # EX_UNAVAILABLE: a store kept failing past storage.retry_seconds; retried later
