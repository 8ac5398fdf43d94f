"""What a compiled step is made of, as data for the report page: the mesh on the slice's chips, each parameter
family's placement, the collectives per mesh axis read from the compiled HLO, the activations kept for the
backward pass, and the pipeline schedules a config allows as tick tables."""

from __future__ import annotations

import collections
import math
import re

import jax
import numpy as np

from olmax.config import ConfigError, RunConfig
from olmax.parallel import pipeline
from olmax.parallel.mesh import Layout

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

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.+?) ([a-z][\w-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.-]+) .*\{$")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}


def _array_bytes(type_text: str) -> list[int]:
    """Bytes of each array in an HLO type (a tuple has several)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(type_text):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
        sizes.append(math.prod(int(d) for d in dims.split(",") if d) * bits // 8)
    return sizes


def _groups(rest: str, n_devices: int) -> list[list[int]]:
    if found := re.search(r"source_target_pairs=\{(.*?)\}\}", rest):
        return [[int(v) for v in pair.split(",")] for pair in re.findall(r"\{?(\d+,\d+)", found.group(1))]
    if found := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest):
        groups, size, dims, perm = found.groups()
        ids = np.arange(n_devices).reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.transpose([int(p) for p in perm.split(",")])
        return ids.reshape(int(groups), int(size)).tolist()
    if found := re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", rest):
        return [[int(v) for v in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", found.group(1))]
    return [list(range(n_devices))]


def _axes_of(groups: list[list[int]], mesh_shape: dict) -> str:
    """The mesh axes along which the members of a collective's groups differ ('-' for none)."""
    coords = np.stack(np.unravel_index(np.asarray(groups[0]), tuple(mesh_shape.values())), axis=-1)
    varying = [name for i, name in enumerate(mesh_shape) if len(set(coords[:, i])) > 1]
    return "+".join(varying) or "-"


def collectives(hlo: str, mesh_shape: dict) -> dict:
    """Collectives per mesh axis and kind: how many the step runs and the bytes each device sends or receives
    per step (the larger of a collective's input and output). A loop body counts as often as its loop runs where
    the loop's condition compares with a constant (a scan's); other loops (an MoE's expert block loops, bounded
    by data) count once, and `loops_without_trip_count` says how many such loop runs there were."""
    n_devices = math.prod(mesh_shape.values())
    computations, current, types = {}, None, {}
    for line in hlo.splitlines():
        if found := _COMPUTATION.match(line):
            current = computations.setdefault(found.group(2), {"calls": [], "ops": [], "entry": bool(found.group(1)),
                                                               "bounds": []})
            continue
        found = _INSTRUCTION.match(line)
        if not found or current is None:
            continue
        name, type_text, op, rest = found.groups()
        types[name] = type_text
        if op == "constant" and re.fullmatch(r"s32\[\]\S*", type_text):
            current["bounds"].append(int(re.match(r"-?\d+", rest).group()))
        if op == "while":
            body = re.search(r"body=%([\w.-]+)", rest).group(1)
            condition = re.search(r"condition=%([\w.-]+)", rest).group(1)
            current["calls"].append((body, condition))
            continue
        for callee in re.findall(r"(?:to_apply|calls|true_computation|false_computation)=%([\w.-]+)", rest):
            current["calls"].append((callee, 1))
        for branches in re.findall(r"branch_computations=\{([^}]*)\}", rest):
            current["calls"] += [(b.strip().lstrip("%"), 1) for b in branches.split(",")]
        kind = op.removesuffix("-start")
        if kind in COLLECTIVES and not op.endswith("-done"):
            operands = re.findall(r"%([\w.-]+)", rest.split(")")[0])
            sizes = _array_bytes(type_text) + [b for o in operands for b in _array_bytes(types.get(o, ""))]
            current["ops"].append((kind, _axes_of(_groups(rest, n_devices), mesh_shape), max(sizes, default=0)))
    totals = collections.defaultdict(lambda: {"count": 0, "bytes_per_step": 0})
    unknown = 0

    def visit(name: str, times: int, depth: int = 0):
        nonlocal unknown
        computation = computations.get(name)
        if computation is None or depth > 64:
            return
        for kind, axes, size in computation["ops"]:
            entry = totals[(axes, kind)]
            entry["count"] += times
            entry["bytes_per_step"] += times * size
        for callee, trips in computation["calls"]:
            if isinstance(trips, str):  # a while body: a scan's loop compares its counter with one constant
                bounds = computations.get(trips, {}).get("bounds", [])
                unknown += len(bounds) != 1
                trips = bounds[0] if len(bounds) == 1 else 1
            visit(callee, times * trips, depth + 1)

    for name, computation in computations.items():
        if computation["entry"]:
            visit(name, 1)
    rows = [{"axes": axes, "kind": kind, **v} for (axes, kind), v in sorted(totals.items())]
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
    sched = pipeline.schedule_for(cfg)
    if sched is None:
        return m.n_layers * tokens_per_device * per_layer_token * dtype_bytes
    layers_per_stage, tokens_per_microbatch = m.n_layers // sched.stages, tokens_per_device // sched.microbatches
    if sched.loss_inside:  # chunk inputs kept, and the named activations of the one chunk being differentiated
        chunk = layers_per_stage // sched.repeats
        return tokens_per_microbatch * dtype_bytes * (sched.in_flight * m.d_model + chunk * per_layer_token)
    return sched.microbatches * layers_per_stage * tokens_per_microbatch * per_layer_token * dtype_bytes


def memory_stack(report: dict) -> list[dict]:
    """One device's memory at the compiler's peak, stacked: the segments add up to the peak exactly, and `free`
    to the device's memory. Activations are the remat estimate, capped at what the peak leaves after the
    arguments and gradients; temporaries are the rest of the peak."""
    rest = report["peak"] - report["arguments"] - report["gradients"]
    activations = min(report["saved_activations_estimate"], max(rest, 0))
    other_arguments = report["arguments"] - report["parameters"] - report["optimizer_state"]
    return [
        {"segment": "parameters", "bytes": report["parameters"]},
        {"segment": "optimizer state", "bytes": report["optimizer_state"]},
        {"segment": "batch and other arguments", "bytes": other_arguments},
        {"segment": "gradients", "bytes": report["gradients"]},
        {"segment": "activations kept for the backward", "bytes": activations},
        {"segment": "temporaries", "bytes": rest - activations},
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
            sched = pipeline.schedule_for(cfg.model_copy(update={"impl": cfg.impl.model_copy(update={"pipeline": pipe})}))
        except ConfigError as err:
            tables.append({"schedule": name, "allowed": False, "why": str(err)})
            continue
        tables.append({"schedule": name, "allowed": True, "configured": name == own, "name": sched.title,
                       "stages": sched.stages, "microbatches": sched.microbatches, "chunks_per_stage": sched.repeats,
                       "bubble_fraction": sched.bubble, "in_flight_microbatches": sched.in_flight,
                       "ticks": _tick_table(sched)})
    return tables


def _tick_table(sched: pipeline.Schedule) -> list[list[dict | None]]:
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
