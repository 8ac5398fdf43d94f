"""Interop with HF transformers and OLMo-core: safetensors I/O (hf.py) and logit parity (parity.py); each
model family (olmax.model.families) does its own config and tensor-name mapping.

Kept free of imports beyond olmax.errors, so the CLI can catch InteropError without loading jax.
"""

from olmax.errors import InteropError

__all__ = ["InteropError"]
