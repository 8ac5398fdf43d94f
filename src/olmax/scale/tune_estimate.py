"""`olmax tune`'s quick estimate of a layout before it is compiled (`Estimate`): the order in which the search tries
the candidates, most promising first."""

from __future__ import annotations

import math

from jax.sharding import AbstractMesh

from olmax.config import MESH_AXES, RunConfig
from olmax.model import families, flops
from olmax.parallel import moe_sizing
from olmax.parallel import schedules
from olmax.parallel.mesh import Layout, spec_axes
from olmax.scale import anatomy
from olmax.scale.targets import Target
from olmax.scale.tune_space import EVERYTHING, NAMED, Candidate, configured

class Estimate:
    """(seconds, bytes a device) of a candidate before compiling: the training FLOPs and what the policy recomputes
    at the matmul rate; the weights the mesh gathers each micro-step, the gradients it reduces and an MoE's tokens
    exchanged, at the links' rate; and the parameters, gradients and optimizer state a device holds (as the config's
    mesh rules shard them: an MoE's experts over the expert and stage axes only, never gathered), the activations
    the policy saves, and an MoE layer's routed rows and its experts' weights in its backward pass. Only an order
    for the search: the compiled program and the step-time model judge. Figures per mesh and per (remat,
    micro-batch) are kept, as the search estimates tens of thousands of candidates."""

    def __init__(self, cfg: RunConfig, target: Target):
        self.cfg, self.target = cfg, target
        self.count = flops.count(cfg.model, cfg.data.sequence_length)
        self.params = families.table(cfg.model)
        self.expert_params = sum(math.prod(p.shape) for p in self.params if "experts" in p.axes)
        self._held: dict = {}
        self._saved: dict = {}
        self._bubble: dict = {}
        self._figures: dict = {}

    def held(self, mesh: dict) -> tuple[int, int]:
        """(dense, expert) parameters one device holds on `mesh`."""
        key = tuple(mesh.items())
        if key not in self._held:
            layout = Layout(AbstractMesh(tuple(mesh[a] for a in MESH_AXES), MESH_AXES),
                            {name: tuple(axes) for name, axes in self.cfg.mesh.rules.items()})
            held = [0, 0]
            for p in self.params:
                spec = layout.spec(p.axes, p.shape)
                held["experts" in p.axes] += math.prod(p.shape) // math.prod(
                    mesh[axis] for entry in spec for axis in spec_axes(entry))
            self._held[key] = tuple(held)
        return self._held[key]

    def saved(self, candidate: Candidate) -> int:
        """The activations one device keeps for the backward pass (before tensor parallelism splits them)."""
        stage = dict(candidate.mesh)["stage"]
        key = (candidate.saved, candidate.micro_batch, stage, candidate.pipeline)
        if key not in self._saved:
            self._saved[key] = anatomy.saved_activation_bytes(
                configured(self.cfg, stage, candidate.pipeline, candidate.remat),
                candidate.micro_batch * self.cfg.data.sequence_length, 2)
        return self._saved[key]

    def layer_tokens(self, candidate: Candidate) -> int:
        """The tokens a device runs a layer on at a time (moe_sizing.layer_tokens)."""
        return moe_sizing.layer_tokens(self.cfg, candidate.micro_batch, candidate.pipeline[1] if candidate.pipeline
                                       else 1)

    def bubble(self, candidate: Candidate) -> float:
        """The share of a stage's time idle in the pipeline's fill and drain."""
        if not candidate.pipeline:
            return 0.0
        key = (dict(candidate.mesh)["stage"], candidate.pipeline)
        if key not in self._bubble:
            self._bubble[key] = schedules.schedule_for(configured(self.cfg, *key)).bubble
        return self._bubble[key]

    def layer_rows(self, candidate: Candidate) -> moe_sizing.LayerRows:
        """An MoE layer's rows on one device of the candidate's layout (olmax.parallel.moe_sizing)."""
        return moe_sizing.config_rows(self.cfg, dict(candidate.mesh)["expert"], candidate.micro_batch,
                                      candidate.pipeline[1] if candidate.pipeline else 1)

    def routed(self, candidate: Candidate) -> tuple[int, int, int]:
        """An MoE layer on one device: (the rows its experts run at a time, the expert outputs it gathers back at a
        time, the rows it receives over the expert axis in all); zeros for a dense model. Each device of an expert
        group runs its experts on what its peers send: with a capacity a peer, that many rows from each; dropless,
        every token of the group, once for each local expert it chose, or with impl.moe.ep_buffer a round's buffer,
        one of impl.moe.exchange_chunks parts at a time (olmax.parallel.expert, olmax.model.moe.experts)."""
        if self.cfg.model.mlp != "moe":
            return 0, 0, 0
        rows = self.layer_rows(candidate)
        tokens, k, peers = rows.tokens, rows.top_k, rows.ep
        if peers == 1:
            return tokens * min(k, rows.local_experts), rows.routed, 0
        if rows.capacity is not None:
            return rows.received, rows.received, rows.received
        parts = self.cfg.impl.moe.exchange_chunks
        if rows.slots is not None:  # a round's buffer, the expected routing's one round
            return rows.slots, rows.slots, rows.received * parts
        return peers * tokens * min(k, rows.local_experts), peers * rows.routed, rows.received * parts

    def __call__(self, candidate: Candidate) -> tuple[float, float]:
        # Splash's tiles and the flag profile do not change the estimate: one figure for all of them
        key = (candidate.mesh, candidate.saved, candidate.micro_batch, candidate.pipeline, candidate.zero1)
        if key not in self._figures:
            self._figures[key] = self._estimate(candidate)
        return self._figures[key]

    def _estimate(self, candidate: Candidate) -> tuple[float, float]:
        cfg, target, count = self.cfg, self.target, self.count
        m, seq = cfg.model, cfg.data.sequence_length
        mesh = dict(candidate.mesh)
        tokens = cfg.train.global_batch_instances * seq / target.devices
        hidden = m.moe.top_k * m.moe.expert_hidden if m.mlp == "moe" else m.mlp_hidden
        per_token = {"qkv_proj": (m.n_heads + 2 * m.kv_heads) * m.head_size * m.d_model,
                     "out_proj": m.n_heads * m.head_size * m.d_model, "mlpwi_0": m.d_model * hidden,
                     "mlpwi_1": m.d_model * hidden, "mlpwo": hidden * m.d_model,
                     "context": 2 * m.n_heads * m.head_size * min(seq, m.sliding_window or seq)}
        kept = NAMED if candidate.saved == EVERYTHING else candidate.saved
        recompute = sum(2 * v for name, v in per_token.items() if name not in kept) * m.n_layers
        a = target.accelerator
        rate = a.peak_flops_per_chip / a.devices_per_chip * a.matmul_efficiency
        compute = tokens * (count.per_token + recompute) / rate / (1 - self.bubble(candidate))
        dense, experts = self.held(mesh)
        weights = 2 * (count.params - self.expert_params)  # bf16 bytes FSDP gathers (experts stay resident)
        micro_steps = cfg.train.global_batch_instances // (candidate.micro_batch * math.prod(
            size for axis, size in candidate.mesh if axis in ("data", "fsdp", "expert")))
        fsdp, data, tensor = mesh["fsdp"], mesh["data"], mesh["tensor"]
        link = max(a.link_bandwidth, a.network_bandwidth, 1.0) * 2
        moved = (2 * micro_steps + 1) * weights / tensor * (fsdp - 1) / max(fsdp, 1) + 2 * weights * (data - 1) / data
        # tensor parallelism: each device sees its group's tokens, and sums the attention's and the MLP's outputs
        # over the group in the forward pass, the backward pass and the recomputation (6 all-reduces a layer)
        moved += 6 * m.n_layers * tokens * tensor * m.d_model * 2 * 2 * (tensor - 1) / tensor
        # an expert's float32 gradient is summed over the devices that hold the same experts (data x fsdp), and
        # the routed tokens go out and come back in the forward pass, the backward pass and the recomputation
        # (none where remat keeps everything: olmax.parallel.expert.EXCHANGED)
        replicas = data * fsdp
        moved += 2 * 4 * experts * (replicas - 1) / replicas
        rows, outputs, received = self.routed(candidate)
        peers = mesh["expert"]
        passes = 4 if candidate.saved == EVERYTHING else 6
        moved += (passes * received / self.layer_tokens(candidate) * tokens * tensor * m.n_layers * m.d_model * 2
                  * (peers - 1) / peers)
        comm = moved / link
        # float32 parameters, gradients and two moments; ZeRO-1 shards the moments over the replicas
        moments = dense / (data if candidate.zero1 else 1) + experts / (replicas if candidate.zero1 else 1)
        state = (dense + experts) * (4 + 4) + moments * (4 + 4)
        memory = state + self.saved(candidate) / tensor
        if rows:
            d, f, local = m.d_model, m.moe.expert_hidden, m.moe.num_experts // peers
            # the routed rows' input, two projections, their product and output, and the gradients of each
            # (bf16); each token's outputs back from its experts, in bf16 and in the float32 of the gated sum;
            # the layer's experts cast to bf16, and their float32 gradients as the backward pass sums them
            memory += rows * (2 * d + 3 * f) * 2 * 2 + outputs * d * (2 + 4) + local * 3 * d * f * (2 + 4)
        return max(compute, comm) + 0.1 * min(compute, comm), memory
