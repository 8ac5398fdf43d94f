"""What a compiled step is made of, as data for the report page: the mesh on the slice's chips, each parameter
family's placement, the collectives per mesh axis read from the compiled HLO, the activations kept for the
backward pass, and the pipeline schedules a config allows as tick tables."""

from __future__ import annotations

import collections
import math

import jax
import numpy as np

from olmax.config import ConfigError, RunConfig
from olmax.parallel.schedules import Schedule, schedule_for
from olmax.parallel.mesh import Layout
from olmax.scale import hlo

PHYSICAL_DIMENSIONS = ("x", "y", "z")
FAMILIES = {  # a parameter's name -> its family
    "embed": "embeddings", "lm_head": "LM head", "q_proj": "attention projections", "k_proj": "attention projections",
    "v_proj": "attention projections", "o_proj": "attention projections", "router": "router",
    "w1": "MLP", "w2": "MLP", "w3": "MLP",
}


def mesh_axes(layout: Layout) -> list[dict]:
    """Each mesh axis, its size, and how far it steps along each physical dimension of the slice (TPU chips'
    coordinates, the cores of a chip; a GPU host's process and device index where there are no coordinates)."""
    devices = layout.mesh.devices
    origin = devices.flat[0]
    axes = []
    for i, (name, size) in enumerate(layout.mesh.shape.items()):
        spans = {}
        if size > 1:
            index = [0] * devices.ndim
            members = []
            for k in range(size):
                index[i] = k
                members.append(devices[tuple(index)])
            for dim, coordinate in _coordinates(origin).items():
                values = {_coordinates(d)[dim] for d in members}
                if len(values) > 1:
                    spans[dim] = len(values)
        axes.append({"axis": name, "size": size, "spans": spans})
    return axes


def _coordinates(device) -> dict:
    coords = getattr(device, "coords", None)
    if coords is not None:
        found = dict(zip(PHYSICAL_DIMENSIONS, coords))
        return {**found, "core": getattr(device, "core_on_chip", 0)}
    return {"host": device.process_index, "device": device.id}


def chip_grid(layout: Layout) -> list[dict]:
    """Every device's physical coordinates and its index along each mesh axis: the mesh drawn on the slice."""
    coords = np.stack(np.unravel_index(np.arange(layout.mesh.devices.size), layout.mesh.devices.shape), axis=-1)
    return [{"at": _coordinates(d), "index": dict(zip(layout.mesh.shape, map(int, c)))}
            for d, c in zip(layout.mesh.devices.flat, coords)]


def parameter_table(params) -> list[dict]:
    """Every parameter: its family, global shape, partition spec and the bytes one device holds (fp32)."""
    rows = []
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = str(getattr(path[-1], "key", path[-1]))
        family = "norms" if name.endswith("norm") else FAMILIES.get(name, "other")
        if family == "MLP" and len(x.shape) == 4:  # [layers, experts, in, out]
            family = "experts"
        rows.append({"family": family, "name": jax.tree_util.keystr(path), "shape": list(x.shape),
                     "dtype": x.dtype.name, "spec": [_spec_entry(e) for e in x.sharding.spec],
                     "bytes_per_device": math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize})
    return rows


def _spec_entry(entry) -> str | None:
    if entry is None:
        return None
    return "+".join(entry) if isinstance(entry, tuple) else entry


# --- collectives, read from the compiled HLO text ---------------------------------------------------------------

COLLECTIVES = hlo.COLLECTIVES


def _axes_of(groups: list[list[int]], mesh_shape: dict) -> str:
    """The mesh axes along which the members of a collective's groups differ ('-' for none)."""
    coords = np.stack(np.unravel_index(np.asarray(groups[0]), tuple(mesh_shape.values())), axis=-1)
    varying = [name for i, name in enumerate(mesh_shape) if len(set(coords[:, i])) > 1]
    return "+".join(varying) or "-"


def _produced_by_update(module: hlo.Module, computation: hlo.Computation, name: str) -> bool:
    """Whether an operand is a dynamic-update-slice (a shard written into a buffer of zeros), or a fusion whose
    result is one."""
    source = computation.by_name.get(name)
    if source is None:
        return False
    if source.op == "dynamic-update-slice":
        return True
    if source.op == "fusion" and (fused := module.computation(source.calls()[0])) is not None:
        return fused.root.op == "dynamic-update-slice"
    return False


def implemented(module: hlo.Module, computation: hlo.Computation, instruction: hlo.Instruction,
                readers: dict) -> str | None:
    """What an all-reduce really is. The TPU compiler turns FSDP's all-gathers into all-reduces of the device's
    shard written into zeros (each device contributes its slice, the sum is the whole), and reduce-scatters into
    all-reduces of which each device keeps its slice: the bytes are an all-reduce's, the purpose a gather's or a
    scatter's."""
    if instruction.op.removesuffix("-start") != "all-reduce":
        return None
    if instruction.operands and all(_produced_by_update(module, computation, o) for o in instruction.operands):
        return "all-gather"
    users = readers.get(instruction.name, [])
    while users and all(u.op == "get-tuple-element" for u in users):
        users = [r for u in users for r in readers.get(u.name, [])]
    if users and all(u.op in ("dynamic-slice", "all-reduce-done") or "dynamic-slice" in u.name for u in users):
        return "reduce-scatter"
    return None


def collectives(text: str, mesh_shape: dict) -> dict:
    """Collectives per mesh axis and kind: how many the step runs and the bytes each device sends or receives
    per step (the larger of a collective's inputs and outputs). An all-reduce that stands for an all-gather or a
    reduce-scatter says so (`as`). A loop body counts as often as its loop runs where the compiler knows the trip
    count or the loop's condition compares with one constant (a scan's); other loops (an MoE's expert block
    loops, bounded by data) count once, and `loops_without_trip_count` says how many such loop runs there were."""
    module = hlo.Module(text)
    n_devices = math.prod(mesh_shape.values())
    totals = collections.defaultdict(lambda: {"count": 0, "bytes_per_step": 0})
    unknown = 0

    def visit(name: str, times: int, depth: int = 0):
        nonlocal unknown
        computation = module.computation(name)
        if computation is None or depth > 64:
            return
        readers = collections.defaultdict(list)
        for instruction in computation.instructions:
            for operand in instruction.operands:
                readers[operand].append(instruction)
        for instruction in computation.instructions:
            kind = instruction.op.removesuffix("-start")
            if instruction.op == "while":
                trips = module.trip_count(instruction, computation)
                unknown += trips is None
                visit((instruction.attribute("body") or "").lstrip("%"), times * (trips or 1), depth + 1)
                continue
            if kind in COLLECTIVES and not instruction.op.endswith("-done"):
                arrays = [a for o in instruction.operands
                          for a in (computation.by_name[o].outputs if o in computation.by_name else [])]
                inputs, outputs = sum(a.bytes for a in arrays), sum(a.bytes for a in instruction.results(arrays))
                axes = _axes_of(hlo.replica_groups(instruction, n_devices), mesh_shape)
                entry = totals[(axes, kind, implemented(module, computation, instruction, readers))]
                entry["count"] += times
                entry["bytes_per_step"] += times * int(max(inputs, outputs))
            for callee in instruction.calls():
                if instruction.op != "fusion":
                    visit(callee, times, depth + 1)

    visit(module.entry, 1)
    rows = [{"axes": axes, "kind": kind, "as": purpose, **v}
            for (axes, kind, purpose), v in sorted(totals.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or ""))]
    return {"by_axis": rows, "loops_without_trip_count": unknown}


# --- activations kept for the backward pass ------------------------------------------------------------------------

def saved_activation_bytes(cfg: RunConfig, tokens_per_device: int, dtype_bytes: int) -> int:
    """The activations one device keeps from the forward pass for the backward, by the remat policy: each layer's
    input, plus, per layer, the named activations the policy saves (all of them with remat none). An estimate
    from the shapes, not the compiler's buffer assignment, which does not label its buffers."""
    m = cfg.model
    moe = m.moe if m.mlp == "moe" else None
    hidden = moe.top_k * moe.expert_hidden if moe else m.mlp_hidden
    widths = {"qkv_proj": (m.n_heads + 2 * m.kv_heads) * m.head_size, "out_proj": m.d_model, "mlpwi_0": hidden,
              "mlpwi_1": hidden, "mlpwo": (moe.top_k if moe else 1) * m.d_model, "context": m.n_heads * m.head_size}
    remat = cfg.impl.remat
    saved = {"full": [], "none": list(widths)}.get(remat, remat) if isinstance(remat, str) else remat
    per_layer_token = m.d_model + sum(widths[name] for name in saved)
    sched = schedule_for(cfg)
    if sched is None:
        return m.n_layers * tokens_per_device * per_layer_token * dtype_bytes
    layers_per_stage, tokens_per_microbatch = m.n_layers // sched.stages, tokens_per_device // sched.microbatches
    if sched.loss_inside:  # chunk inputs kept, and the named activations of the one chunk being differentiated
        chunk = layers_per_stage // sched.repeats
        return tokens_per_microbatch * dtype_bytes * (sched.in_flight * m.d_model + chunk * per_layer_token)
    return sched.microbatches * layers_per_stage * tokens_per_microbatch * per_layer_token * dtype_bytes


def _forward_loop(loop: hlo.Instruction) -> bool:
    """A loop of the forward pass that the backward differentiates, at its top: over the layer groups, over the
    loss's chunks (JAX names it `.../jvp(...)/while`; the backward's are under `transpose(jvp(...))`, and a
    loop inside one of them names two whiles after its jvp)."""
    if loop.op != "while" or "transpose(" in loop.op_name:
        return False
    _, jvp, inside = loop.op_name.partition("jvp(")
    return bool(jvp) and inside.count("while") == 1


def _written_in_place(module: hlo.Module, computation: hlo.Computation, name: str) -> bool:
    """Whether an instruction updates a slice of a buffer of its own shape: a dynamic-update-slice, or a fusion
    with one of the fusion's shape (on a CPU the fusion may convert the whole buffer after it)."""
    source = computation.by_name.get(name)
    if source is None or source.op not in ("dynamic-update-slice", "fusion"):
        return False
    if source.op == "dynamic-update-slice":
        return True
    fused = module.computation(source.calls()[0])
    dims = [a.dims for a in source.outputs]
    return fused is not None and any(i.op == "dynamic-update-slice" and [a.dims for a in i.outputs] == dims
                                     for i in fused.instructions)


def program_memory(text: str) -> dict:
    """Two parts of a compiled step's memory, read from its program (bytes per device):

    residuals: what the forward keeps for the backward, the outputs its loops (over layer groups, over the loss's
        chunks) write iteration by iteration into buffers that outlive them, which the backward's loops read back
        (the stacked outputs of a forward loop built by dynamic-update-slice; a loop's carry and what it passes
        through are not counted);
    gathered_weights: the most that one iteration of a loop gathers (a layer group's weights from their FSDP
        shards, or the LM head's): what is held whole at once while a layer or the head runs, prefetching aside.
    """
    module = hlo.Module(text)
    residuals = gathered = 0
    for computation in module.computations.values():
        for loop in computation.instructions:
            if loop.op != "while" or (body := module.computation((loop.attribute("body") or "").lstrip("%"))) is None:
                continue
            if _forward_loop(loop) and body.root.op == "tuple":
                residuals += sum(a.bytes for name in body.root.operands if _written_in_place(module, body, name)
                                 for a in body.by_name[name].outputs)
            gathers = [i for i in body.instructions if i.op in ("all-gather", "all-gather-start")]
            gathered = max(gathered, sum(i.results([])[-1].bytes for i in gathers))
    return {"residuals": int(residuals), "gathered_weights": int(gathered)}


def memory_stack(report: dict) -> list[dict]:
    """One device's memory at the compiler's peak, stacked: the segments add up to the peak exactly, and `free`
    to the device's memory. Parameters, optimizer state and the batch are the program's arguments; gradients the
    float32 accumulator, the parameters' size; residuals and gathered weights as the program has them
    (program_memory), each capped at what the peak leaves; temporaries are the rest of the peak."""
    rest = report["peak"] - report["arguments"] - report["gradients"]
    residuals = min(report["residuals"], max(rest, 0))
    gathered = min(report["gathered_weights"], max(rest - residuals, 0))
    other_arguments = report["arguments"] - report["parameters"] - report["optimizer_state"]
    return [
        {"segment": "parameters", "bytes": report["parameters"]},
        {"segment": "optimizer state", "bytes": report["optimizer_state"]},
        {"segment": "batch and other arguments", "bytes": other_arguments},
        {"segment": "gradients", "bytes": report["gradients"]},
        {"segment": "residuals kept for the backward", "bytes": residuals},
        {"segment": "gathered weights", "bytes": gathered},
        {"segment": "temporaries", "bytes": rest - residuals - gathered},
        {"segment": "free", "bytes": report["memory_per_device"] - report["peak"]},
    ]


# --- pipeline schedules as tick tables -------------------------------------------------------------------------------

def schedules(cfg: RunConfig) -> list[dict]:
    """Every schedule the config's stages allow (its own first), each as a ticks x stages table: in each cell the
    micro-batch a stage runs forward ('F') and backward ('B'), and the chunk (pass) it runs, or null when idle."""
    if cfg.mesh.stage == 1:
        return []
    own = cfg.impl.pipeline.schedule
    names = [own] + [n for n in ("gpipe", "circular", "1f1b", "interleaved_1f1b") if n != own]
    tables = []
    for name in names:
        repeats = cfg.impl.pipeline.repeats if name in ("circular", "interleaved_1f1b") else None
        pipe = cfg.impl.pipeline.model_copy(update={"schedule": name, "repeats": repeats})
        try:
            sched = schedule_for(cfg.model_copy(update={"impl": cfg.impl.model_copy(update={"pipeline": pipe})}))
        except ConfigError as err:
            tables.append({"schedule": name, "allowed": False, "why": str(err)})
            continue
        tables.append({"schedule": name, "allowed": True, "configured": name == own, "name": sched.title,
                       "stages": sched.stages, "microbatches": sched.microbatches, "chunks_per_stage": sched.repeats,
                       "bubble_fraction": sched.bubble, "in_flight_microbatches": sched.in_flight,
                       "ticks": _tick_table(sched)})
    return tables


def _tick_table(sched: Schedule) -> list[list[dict | None]]:
    S, M, R = sched.stages, sched.microbatches, sched.repeats
    if not sched.loss_inside:  # forward iterations; autodiff's backward runs them in reverse
        rows = []
        for t in range(sched.iterations):
            row = []
            for s in range(S):
                u = t - s  # the u-th (r M + m) unit of work reaching stage s
                row.append({"F": u % M, "chunk": u // M} if 0 <= u < M * R else None)
            rows.append(row)
        return rows
    table = sched.ticks()
    rows = []
    for t in range(table.f_mb.shape[0]):
        row = []
        for s in range(S):
            cell = {}
            if table.f_mb[t, s] >= 0:
                cell["F"], cell["chunk"] = int(table.f_mb[t, s]), int(table.f_rep[t, s])
            if table.b_mb[t, s] >= 0:
                cell["B"], cell["b_chunk"] = int(table.b_mb[t, s]), int(table.b_rep[t, s])
            row.append(cell or None)
        rows.append(row)
    return rows
