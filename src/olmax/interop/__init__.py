"""Interop with HF transformers and OLMo-core: safetensors I/O (hf.py) and logit parity (parity.py); each
model family (olmax.model.families) does its own config and tensor-name mapping.

Their error, `InteropError` (input that cannot be converted or compared), is olmax.errors', named here too.
"""

from olmax.errors import InteropError

__all__ = ["InteropError"]
