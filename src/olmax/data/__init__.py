"""Data: OLMo token shards, OLMo-core's exact instance order, the repetition filter, a checkpointable loader."""

from olmax.data.loader import Loader, build_loader
from olmax.data.shards import DataError

__all__ = ["DataError", "Loader", "build_loader"]
