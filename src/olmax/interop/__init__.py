"""Interop with HF transformers and OLMo-core: checkpoint conversion and logit parity."""

from olmax.interop.hf import InteropError, hf_to_olmax, load_olmax, olmax_to_hf

__all__ = ["InteropError", "hf_to_olmax", "load_olmax", "olmax_to_hf"]
