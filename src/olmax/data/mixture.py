"""Mid-training mixes: instances per shard from per-source ratios, as OLMo-core's SourceMixtureDatasetConfig.

Source s of a mix of R requested tokens needs int(R * ratio_s) tokens, taken as
the same fraction (rounded up) of each of its shards; a source needing more
than it holds is read in passes (whole ones, then a partial one), each pass a
new occurrence of its shards in the mix, up to `max_repetition_ratio` passes.
The occurrences' tokens are then made whole instances that fill
ceil(R / global batch tokens) global batches: floor, then the missing ones
spread evenly and by largest remainder (Hamilton), never more than a shard
holds. An occurrence with n instances gives its shard's first n instances.
Global instance ids follow the sources' order; occurrences given no instance
are dropped. The order on top is the plain mix's (order.py).

OLMo-core's mixture `seed` has no counterpart: it samples instance index files
that its dataset writes but never reads, so it changes no token of any batch.
"""

from __future__ import annotations

import math

from olmax.data.shards import DataError, Source, count_tokens, read_mix_file


def source_paths(source, mix: list[Source] | None) -> list[str]:
    """The source's shards: its own paths, or the mix file's lines labeled with its name."""
    if source.paths:
        return list(source.paths)
    paths = [s.path for s in mix if s.label == source.name]
    if not paths:
        raise DataError(f"data.sources {source.name!r}: data.mix_file has no line labeled {source.name!r}; "
                        f"label its shards `{source.name},PATH` or set the source's paths")
    return paths


def passes(take_ratio: float) -> list[float]:
    """The share of the source each pass reads (OLMo-core's float arithmetic, so the same tokens)."""
    if take_ratio <= 1:
        return [take_ratio]
    shares, remaining = [], take_ratio
    while remaining > 0:
        shares.append(min(1.0, remaining))
        remaining -= shares[-1]
    return shares


def apportion(desired_tokens: list[int], capacity: list[int], requested_instances: int, length: int) -> list[int]:
    """Whole instances per occurrence: floor of the desired tokens, topped up to `requested_instances`."""
    instances = [min(tokens // length, most) for tokens, most in zip(desired_tokens, capacity)]
    remainders = [tokens % length / length for tokens in desired_tokens]  # read only where n < most, as OLMo-core
    eligible = [i for i, (n, most) in enumerate(zip(instances, capacity)) if n < most]
    missing = requested_instances - sum(instances)
    if missing <= 0 or not eligible:
        return instances
    for i in eligible:
        instances[i] += min(missing // len(eligible), capacity[i] - instances[i])
    missing = requested_instances - sum(instances)
    # Ties go to the later occurrence, as OLMo-core's descending sort of (remainder, index).
    largest = sorted(((remainders[i], i) for i in eligible if instances[i] < capacity[i]), reverse=True)
    for _, i in largest[:missing]:
        instances[i] += 1
    return instances


def select_mixture(data, *, global_batch_instances: int) -> tuple[list[Source], list[int]]:
    """The shard occurrences of `data.sources`'s mix (labeled by source) in mix order, and the instances each gives."""
    mix = read_mix_file(data.mix_file, data.mix_base_dir, data.mix_tokenizer) if data.mix_file else None
    length = data.sequence_length
    occurrences: list[tuple[Source, int, int]] = []  # shard, tokens wanted, tokens it holds
    for source in data.sources:
        paths = source_paths(source, mix)
        tokens = {path: count_tokens(path, data.token_dtype) for path in paths}
        population = sum(tokens[path] for path in paths)
        needed = int(data.requested_tokens * source.ratio)
        most = int(population * source.max_source_fraction * source.max_repetition_ratio)
        if most < needed:
            raise DataError(
                f"data.sources {source.name!r}: ratio {source.ratio} of data.requested_tokens "
                f"{data.requested_tokens} is {needed} tokens, more than the {most} it may give ({population} tokens "
                f"x max_source_fraction {source.max_source_fraction} x max_repetition_ratio "
                f"{source.max_repetition_ratio}); add shards to it, lower data.requested_tokens or its ratio, or "
                "raise its max_repetition_ratio to repeat it"
            )
        for share in passes(needed / population):
            occurrences += [(Source(source.name, path), math.ceil(tokens[path] * share), tokens[path])
                            for path in paths]
    batches = math.ceil(data.requested_tokens / (global_batch_instances * length))
    instances = apportion([wanted for _, wanted, _ in occurrences], [held // length for _, _, held in occurrences],
                          batches * global_batch_instances, length)
    kept = [(shard, n) for (shard, _, _), n in zip(occurrences, instances) if n]
    return [shard for shard, _ in kept], [n for _, n in kept]


def mixture_facts(data) -> dict:
    """What defines the mixture besides its shards, for the fingerprint."""
    return {
        "requested_tokens": data.requested_tokens,
        "sources": [
            {"name": s.name, "ratio": s.ratio, "max_repetition_ratio": s.max_repetition_ratio,
             "max_source_fraction": s.max_source_fraction}
            for s in data.sources
        ],
    }
