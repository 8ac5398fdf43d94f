"""Attention behind one interface: `make(impl, window, layout)` gives the training attention of a layer,
`q, k, v -> (context, None)`, with q [B, T, Hq, D] already scaled by 1/sqrt(head_dim) and k, v
[B, T, Hkv, D] (grouped KV heads). Decoding passes `cached.attention` instead, whose second output is the
updated KV cache. Implementations: `xla` (blocked, any platform; the CPU path).
"""

from __future__ import annotations

import functools


from olmax.config import ImplConfig
from olmax.model.attention import xla
from olmax.parallel.mesh import Layout


def make(impl: ImplConfig, window: int | None, layout: Layout | None = None):
    """The attention of a layer with this window (None: global), as the block calls it."""
    kernel = functools.partial(xla.attention, window=window, block=impl.attention.block)
    return lambda q, k, v: (kernel(q, k, v), None)
