"""A small learnable generated language, written as real OLMo shards.

Documents come from a fixed random Markov chain: every token has a few
successors with fixed probabilities (EOS's successors start a document), and a
document ends with probability 1/MEAN_DOCUMENT_TOKENS per token. A model that
learns the bigram table reaches about the chain's entropy (at most
ln(BRANCHING) nats per token), far below ln(vocab): a quick-start run shows
learning, not noise. Everything follows from the seed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from olmax.data.shards import (
    TOKEN_DTYPES, DataError, Source, write_mix_file, write_shard, write_shards_record,
)
from olmax.outputs import new_output_dir

BRANCHING = 4
MEAN_DOCUMENT_TOKENS = 128
MAX_CHAINS = 4096


def generate_tokens(*, vocab_size: int, eos_id: int, n_tokens: int, seed: int) -> np.ndarray:
    """n_tokens of documents from the chain, the last one ending with EOS, as int64."""
    if vocab_size < 2 or not 0 <= eos_id < vocab_size:
        raise DataError(f"need vocab_size >= 2 and 0 <= eos_id < vocab_size, got {vocab_size}, {eos_id}")
    rng = np.random.Generator(np.random.PCG64(seed))
    words = np.delete(np.arange(vocab_size), eos_id)
    successors = rng.choice(words, size=(vocab_size, BRANCHING))
    cumulative = np.cumsum(rng.dirichlet(np.ones(BRANCHING), size=vocab_size), axis=1)
    # Independent chains advance together, so the Python loop runs n_tokens / chains times.
    chains = int(np.clip(n_tokens // (8 * MEAN_DOCUMENT_TOKENS), 1, MAX_CHAINS))
    steps = math.ceil(n_tokens / chains)
    tokens = np.empty((chains, steps), dtype=np.int64)
    current = np.full(chains, eos_id)
    for step in range(steps):
        choice = np.minimum((rng.random(chains)[:, None] > cumulative[current]).sum(axis=1), BRANCHING - 1)
        following = successors[current, choice]
        ends = (rng.random(chains) < 1 / MEAN_DOCUMENT_TOKENS) & (current != eos_id)
        current = np.where(ends, eos_id, following)
        tokens[:, step] = current
    stream = tokens.reshape(-1)[:n_tokens]
    stream[-1] = eos_id
    return stream


def write_synthetic_shards(
    out_dir: str | os.PathLike,
    *,
    vocab_size: int,
    eos_id: int,
    n_tokens: int,
    n_shards: int,
    seed: int,
    token_dtype: str = "uint16",
) -> list[str]:
    """Write n_tokens of the generated language as n_shards OLMo shards (split at document ends), with a mix
    file `mix.txt` and the shards record, into a new or empty directory; the shards' paths."""
    if token_dtype not in TOKEN_DTYPES:
        raise DataError(f"token dtype {token_dtype!r} is not one of {sorted(TOKEN_DTYPES)}")
    if n_shards < 1 or n_tokens < 2 * n_shards:
        raise DataError(f"{n_tokens} tokens in {n_shards} shards: need at least one shard and two tokens per shard")
    stream = generate_tokens(vocab_size=vocab_size, eos_id=eos_id, n_tokens=n_tokens, seed=seed)
    ends = np.flatnonzero(stream == eos_id) + 1
    # Shard i ends at the first document end at or after i/n_shards of the stream.
    cuts = ends[np.searchsorted(ends, [n_tokens * (i + 1) // n_shards for i in range(n_shards)])]
    bounds = np.concatenate([[0], cuts])
    if np.any(np.diff(bounds) == 0):
        raise DataError(f"{n_tokens} tokens are too few for {n_shards} shards of whole documents; ask for more tokens")
    names = [f"part-{index:05d}.npy" for index in range(n_shards)]
    with new_output_dir(out_dir, "synth-data", DataError) as partial:
        for name, start, end in zip(names, bounds[:-1], bounds[1:]):
            write_shard(partial / name, stream[start:end].astype(TOKEN_DTYPES[token_dtype]))
        write_mix_file(partial / "mix.txt", [Source("synthetic", str(partial / name)) for name in names])
        write_shards_record(partial, names, token_dtype=token_dtype, vocab_size=vocab_size, eos_id=eos_id)
    return [str(Path(out_dir) / name) for name in names]
