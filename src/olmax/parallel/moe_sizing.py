"""How many rows a mixture-of-experts layer moves and runs on one device, the one place that says it: the rows an
expert is expected to get, the block its rows are padded to, what a round of the exchange takes and what a device
receives. The model sizes its layer from it (olmax.model.moe.sublayer), the compile report and the step-time
model read it (olmax.scale.compile), and so does `olmax tune`'s estimate (olmax.scale.tune_estimate).

A layer runs on `tokens` of a device at once: a micro-step's rows, or with pipeline stages one pipeline
micro-batch's, times the sequence. With expert parallelism over `ep` devices, each sends every peer the tokens
routed there: with a capacity (impl.moe.ep_capacity) at most `peer_capacity` rows each, dropping the rest;
dropless, every token once to each peer holding any of its experts, the device's tokens in impl.moe.exchange_chunks
parts exchanged one after another, each received into a buffer for the worst case (every token of the group) or,
with impl.moe.ep_buffer, `receive_slots` assignments a round, in rounds while a device has more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from olmax.config import RunConfig


def peer_capacity(local_tokens: int, top_k: int, ep: int, factor: float) -> int:
    """Rows a device sends each peer of its expert group: factor x its mean share of the assignments."""
    return max(1, math.ceil(factor * local_tokens * top_k / ep))


def expected_peers(num_experts: int, top_k: int, ep: int) -> float:
    """Devices of an expert group a token is sent to, expected when its top_k distinct experts are uniformly
    drawn from num_experts spread evenly over ep devices: ep x P(a device holds at least one of them)."""
    per_device = num_experts // ep
    return ep * (1 - math.comb(num_experts - per_device, top_k) / math.comb(num_experts, top_k))


def receive_slots(tokens: int, num_experts: int, top_k: int, ep: int, factor: float) -> int:
    """Assignments a bounded exchange takes a round: `factor` x the assignments a device of `tokens` tokens is
    expected to receive (tokens x top_k), at most the worst case (every token of the group, with all of its
    experts a device holds)."""
    return min(ep * tokens * min(top_k, num_experts // ep), max(1, math.ceil(factor * tokens * top_k)))


def auto_block_size(expected_rows: int, groups: int, smallest: int = 16) -> int:
    """A power of two near a quarter of the mean rows per group, in [smallest, 128]: a group's last, partly
    filled block wastes half a block on average (about an eighth of the work), and smaller blocks make
    smaller, less efficient matmuls."""
    target = max(expected_rows // (4 * groups), 1)
    return min(max(1 << (target.bit_length() - 1), smallest), 128)


@dataclass(frozen=True)
class LayerRows:
    """One MoE layer's rows on one device at a time."""

    num_experts: int
    top_k: int
    ep: int  # devices of an expert group (the `expert` mesh axis)
    tokens: int  # a device's tokens one exchange carries: all the layer runs at once, or one dropless part
    capacity: int | None = None  # rows a device sends each peer (impl.moe.ep_capacity); None: dropless
    slots: int | None = None  # assignments a bounded dropless exchange takes a round (impl.moe.ep_buffer)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    @property
    def routed(self) -> int:
        """Assignments a device's experts are expected to run: its tokens x top_k (balanced routing)."""
        return self.tokens * self.top_k

    @property
    def rows_per_expert(self) -> float:
        return self.routed / self.local_experts

    @property
    def sized_for(self) -> int:
        """The rows a device's expert layout is sized for: with a capacity, what its peers may send it; else the
        assignments expected."""
        return self.ep * self.capacity if self.capacity is not None else self.routed

    def block(self, chosen: int | None, smallest: int = 16) -> int:
        """Rows a block of the experts' layout: impl.moe.block where chosen, else `auto_block_size`'s."""
        return chosen or auto_block_size(self.sized_for, self.local_experts, smallest)

    @property
    def received(self) -> int:
        """Rows a device's receive buffer holds (a round's, bounded): a capacity from each peer; dropless, every
        token of the group, or at most a round's assignments. 0 without expert parallelism."""
        if self.ep == 1:
            return 0
        if self.capacity is not None:
            return self.ep * self.capacity
        return self.ep * self.tokens if self.slots is None else min(self.ep * self.tokens, self.slots)

    @property
    def exchanged(self) -> float | None:
        """Rows a device sends its group in a dropless ragged exchange, expected (its tokens x the peers holding
        any of a token's experts); None where there is no such exchange."""
        if self.ep == 1 or self.capacity is not None:
            return None
        return self.tokens * expected_peers(self.num_experts, self.top_k, self.ep)


def layer_rows(num_experts: int, top_k: int, ep: int, device_tokens: int, ep_capacity: float | None = None,
               exchange_chunks: int = 1, ep_buffer: float | None = None) -> LayerRows:
    """The rows of a layer run on `device_tokens` of a device at once over an expert group of `ep` devices, with
    the config's impl.moe.ep_capacity, exchange_chunks and ep_buffer."""
    if ep > 1 and ep_capacity is not None:
        return LayerRows(num_experts, top_k, ep, device_tokens, peer_capacity(device_tokens, top_k, ep, ep_capacity))
    tokens = device_tokens // exchange_chunks if ep > 1 else device_tokens
    slots = receive_slots(tokens, num_experts, top_k, ep, ep_buffer) if ep > 1 and ep_buffer is not None else None
    return LayerRows(num_experts, top_k, ep, tokens, slots=slots)


def layer_tokens(cfg: RunConfig, rows_per_device: int, pipeline_microbatches: int) -> int:
    """The tokens a device runs a layer on at once: `rows_per_device` instances a micro-step, cut into
    `pipeline_microbatches` (1 without pipeline stages: a stage runs one of the pipeline's micro-batches)."""
    return rows_per_device * cfg.data.sequence_length // pipeline_microbatches


def config_rows(cfg: RunConfig, ep: int, rows_per_device: int, pipeline_microbatches: int) -> LayerRows:
    """A config's layer rows on a layout of `ep` expert-parallel devices (`layer_tokens` for the rest)."""
    moe, impl = cfg.model.moe, cfg.impl.moe
    return layer_rows(moe.num_experts, moe.top_k, ep, layer_tokens(cfg, rows_per_device, pipeline_microbatches),
                      impl.ep_capacity, impl.exchange_chunks, impl.ep_buffer)
