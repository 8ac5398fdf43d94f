"""Interop with HF transformers and OLMo-core: checkpoint conversion (hf.py) and logit parity (parity.py).

Kept free of imports, so the CLI can catch InteropError without loading jax.
"""


class InteropError(ValueError):
    """Input that cannot be converted or compared; the message names the file, field or tensors."""
