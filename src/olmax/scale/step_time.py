"""A step's time predicted from its compiled program: a roofline per op, loops times their trip counts,
collectives costed on the target's links, asynchronous collectives hidden behind the compute scheduled
between their start and their done.

Every op of the optimized, scheduled HLO (olmax.scale.hlo) is costed on one device:

- compute (fusions, matmuls, kernels, copies): the larger of its FLOPs at the matrix unit's rate and its
  bytes at the memory's bandwidth. On a GPU a matmul's rate is what XLA's measured GEMM table gives its shape
  and dtype (`gemm_rate`); elsewhere the device's peak for its operands' dtype, times the hardware's achievable
  fraction (`Hardware.matmul_efficiency`), times how well its dimensions fill the matrix unit's tile (a
  contraction of 128 on a 256-wide systolic array runs at half the rate). On a TPU whose clock is known (v5p)
  an op the compiler estimated takes libtpu's estimated cycles instead, and the prediction says how far the
  roofline is from them. Attention kernels (Splash on TPU, cuDNN's on GPU) are costed from their shapes, the
  blocks their mask leaves, and the matmuls each of them runs (forward 2, Splash's dq 3 and dkv 4, cuDNN's
  backward 5); any other kernel from the work olmax.model.kernel_work registers for it (the TPU's ragged-dot
  grouped matmuls), and one it does not know by its bytes, named in the prediction's warnings.
- collectives: their bytes per device over the links the group spans, with the algorithm the platform uses
  (a bidirectional ring per torus dimension, all dimensions at once on a TPU slice with wraparound; NVLink
  within a GPU host and the hosts' network between them; all-to-all by the bisection).
- the schedule: ops run in the order the compiler scheduled them; an asynchronous collective (a `-start` /
  `-done` pair, or an async call) runs beside the compute between its start and its done, and only what is
  left when the done is reached is exposed. A loop's body is simulated twice (a collective started in one
  iteration may finish in the next) and its second iteration counts for all the rest. A loop whose trip count
  the program does not state runs as often as the model derives: the experts' block loops (olmax.model.moe.gmm)
  and a bounded exchange's rounds past its first (olmax.parallel.expert.rounds) by the routing's expectation
  (ExpertBlocks); any other such loop once, named in the warnings.

The result says where the time goes: matmuls, attention, memory-bound work and exposed collectives, by layer
kind (from the op names the model's named scopes write), plus a timeline of one step for the layout page.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import math
import re
from dataclasses import dataclass, field

from olmax.model import kernel_work
from olmax.scale import hlo

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
        "opt-barrier", "add-dependency", "domain", "iota"}
COLLECTIVES = hlo.COLLECTIVES
CATEGORIES = ("matmul", "attention", "memory", "collective")  # compute categories, then exposed communication
# Where libtpu's estimated cycles and the roofline give steps further apart than this, a prediction is a range:
# neither is known to be the better (the v5p 7B's measured step fell between the two)
SPREAD = 0.10


@dataclass(frozen=True)
class Hardware:
    """One device of a target as the model sees it (rates are per device, bytes per second one way)."""

    name: str
    platform: str  # tpu, gpu or cpu
    matmul_flops: dict  # operand dtype -> dense FLOP/s at the datasheet's peak
    matmul_efficiency: float  # the fraction of that peak a large matmul sustains
    memory_bandwidth: float
    memory_efficiency: float
    tile: tuple[int, int, int]  # the matrix unit's (m, n, k): dimensions are padded to multiples of these
    link_bandwidth: float = 0.0  # TPU: one ICI link, one way; GPU: NVLink per GPU, one way
    network_bandwidth: float = 0.0  # GPU: between hosts, per GPU, one way
    collective_efficiency: float = 1.0
    collective_latency: float = 0.0  # seconds per collective
    op_overhead: float = 0.0  # seconds per op launched
    cache_bytes: int = 0  # CPU: an op whose bytes fit its last-level cache moves them at cache_bandwidth
    cache_bandwidth: float = 0.0
    torus: tuple[int, ...] = ()  # TPU: chips per dimension of the slice
    wraparound: bool = False  # TPU: the slice's dimensions close into rings
    devices_per_chip: int = 1
    hosts: int = 1  # GPU: hosts of `devices_per_host`
    devices_per_host: int = 8
    gemm_table: str = ""  # GPU: XLA's measured GEMM table for this architecture (sm_90, sm_100): see gemm_rate
    clock: float = 0.0  # TPU: cycles a second, to read libtpu's estimated cycles per op as seconds


@dataclass
class Cost:
    seconds: float
    category: str  # matmul, attention, memory (compute) or a collective's kind
    flops: float = 0.0
    bytes: float = 0.0
    roofline: float | None = None  # the roofline's seconds, where `seconds` are libtpu's estimate instead
    unknown_kernel: str | None = None  # a custom call the model does not know, costed by its bytes


# --- compute ops --------------------------------------------------------------------------------------------------

def _fill(size: int, tile: int) -> float:
    """How much of a matrix unit's `tile`-wide dimension `size` fills, on average over the tiles it takes."""
    return size / (math.ceil(size / tile) * tile) if size else 1.0


@functools.cache
def _gemm_tables() -> dict:
    from olmax.scale.targets import gemm_table

    return gemm_table()


def gemm_rate(architecture: str, dtype: str, m: int, n: int, k: int) -> float:
    """FLOP/s of an (m, n, k) GEMM on a GPU of `architecture` (sm_90, sm_100), by XLA's measured table
    (olmax/scale/targets/gemm_table.json, its source named there): interpolated linearly in the rate over the
    logarithms of m, n and k between the table's sizes, each size clamped to the table's range (256 to 4096),
    as XLA's own interpolator clamps. A batched matmul's batch is folded into m."""
    tables = _gemm_tables()
    table = tables[architecture]["f8" if dtype.startswith("f8") else "f32" if dtype == "f32" else "bf16"]
    grid = [math.log2(g) for g in tables["grid"]]

    def neighbours(size: int) -> tuple[int, float]:  # the lower grid index and the upper neighbour's weight
        at = min(max(math.log2(max(size, 1)), grid[0]), grid[-1])
        i = min(bisect.bisect_right(grid, at) - 1, len(grid) - 2)
        return i, (at - grid[i]) / (grid[i + 1] - grid[i])

    (i, wi), (j, wj), (h, wh) = neighbours(m), neighbours(n), neighbours(k)
    rate = 0.0
    for a, b, c in ((a, b, c) for a in (0, 1) for b in (0, 1) for c in (0, 1)):
        weight = (wi if a else 1 - wi) * (wj if b else 1 - wj) * (wh if c else 1 - wh)
        rate += weight * table[i + a][j + b][h + c]
    return rate * 1e12


def _gemm_seconds(flops: float, dtype: str, m: int, n: int, k: int, hw: Hardware) -> float:
    """A matmul's time at its FLOP rate: on a GPU with a measured table its shape's rate there, else the peak
    derated by `_matmul_seconds`."""
    if hw.gemm_table:
        return flops / gemm_rate(hw.gemm_table, dtype, m, n, k)
    return _matmul_seconds(flops, dtype, m, n, k, hw)


def _matmul_seconds(flops: float, dtype: str, m: int, n: int, k: int, hw: Hardware) -> float:
    peak = hw.matmul_flops.get(dtype) or hw.matmul_flops.get("f8" if dtype.startswith("f8") else "bf16")
    # the stationary operand's free dimension is the one that fills the unit better (the compiler picks it)
    fill = _fill(k, hw.tile[2]) * max(_fill(n, hw.tile[1]), _fill(m, hw.tile[1])) * _fill(min(m, n), hw.tile[0])
    return flops / (peak * hw.matmul_efficiency * fill)


def _dims(labels: str, shape: tuple[int, ...], letters: str) -> list[int]:
    return [shape[i] for i, c in enumerate(labels) if c in letters]


def _valid_taps(in_size: int, window: int, stride: int, pad_lo: int, lhs_dilation: int, rhs_dilation: int,
                out_size: int) -> int:
    """Summed over the output positions of one spatial dimension, the window taps that land on real input
    (not padding): a convolution that expresses a batched matmul pads its window mostly with zeros."""
    total = 0
    dilated = (in_size - 1) * lhs_dilation + 1
    for o in range(out_size):
        for t in range(window):
            at = o * stride + t * rhs_dilation - pad_lo
            total += 0 <= at < dilated and at % lhs_dilation == 0
    return total


def convolution(instruction: hlo.Instruction, operands: list[hlo.Array]) -> tuple[float, int, int, int, str]:
    """(FLOPs, m, n, k, operand dtype) of a convolution (the form the TPU compiler gives its matmuls)."""
    lhs, rhs = operands[0], operands[1]
    out = instruction.outputs[0]
    labels = re.match(r"(\w+)_(\w+)->(\w+)", instruction.attribute("dim_labels") or "b0f_0io->b0f")
    lhs_l, rhs_l, out_l = labels.groups()
    window = instruction.attribute("window") or ""
    sizes = [int(v) for v in re.findall(r"\d+", re.search(r"size=([\dx]+)", window).group(1))] if "size=" in window else []
    n_spatial = len(sizes)

    def per_dim(key, default):
        found = re.search(rf"{key}=([\d_x-]+)", window)
        if not found:
            return [default] * n_spatial
        return [tuple(int(v) for v in part.split("_")) if "_" in part else int(part)
                for part in found.group(1).split("x")]

    pads, strides = per_dim("pad", (0, 0)), per_dim("stride", 1)
    lhs_dil, rhs_dil = per_dim("lhs_dilate", 1), per_dim("rhs_dilate", 1)
    taps = 1
    for d in range(n_spatial):
        digit = str(d)
        taps *= _valid_taps(lhs.dims[lhs_l.index(digit)], sizes[d], strides[d], pads[d][0], lhs_dil[d], rhs_dil[d],
                            out.dims[out_l.index(digit)])
    batch = math.prod(_dims(out_l, out.dims, "b"))
    features_out = math.prod(_dims(out_l, out.dims, "f"))
    features_in = math.prod(_dims(rhs_l, rhs.dims, "i"))
    flops = 2.0 * batch * features_out * features_in * taps
    spatial_out = math.prod(out.dims[out_l.index(str(d))] for d in range(n_spatial)) if n_spatial else 1
    return flops, batch * spatial_out, features_out, features_in * max(1, taps // max(spatial_out, 1)), lhs.dtype


def dot(instruction: hlo.Instruction, operands: list[hlo.Array], numbers: dict | None = None
        ) -> tuple[float, int, int, int, str]:
    """(FLOPs, m, n, k, operand dtype) of a dot, from its dimension numbers (the attributes' or a GEMM custom
    call's backend config)."""
    lhs, rhs = operands[0], operands[1]

    def dims(side, what):  # HLO text says lhs_contracting_dims, a backend config lhs_contracting_dimensions
        if numbers is not None:
            return [int(v) for v in numbers.get(f"{side}_{what}_dimensions", [])]
        value = instruction.attribute(f"{side}_{what}_dims")
        return [int(v) for v in re.findall(r"\d+", value)] if value else []

    lhs_contract, rhs_contract = dims("lhs", "contracting"), dims("rhs", "contracting")
    lhs_batch, rhs_batch = dims("lhs", "batch"), dims("rhs", "batch")
    k = math.prod(lhs.dims[i] for i in lhs_contract)
    batch = math.prod(lhs.dims[i] for i in lhs_batch)
    m = math.prod(s for i, s in enumerate(lhs.dims) if i not in lhs_contract and i not in lhs_batch)
    n = math.prod(s for i, s in enumerate(rhs.dims) if i not in rhs_contract and i not in rhs_batch)
    return 2.0 * batch * m * n * k, batch * m, n, k, lhs.dtype


@dataclass
class AttentionInfo:
    """What the compiled program cannot say about its attention kernels: each layer's mask, from the config."""

    sequence: int
    windows: dict  # layer kind (sliding, global) -> window in tokens or None
    block_q: int = 512
    block_kv: int = 512

    def attended(self, kind: str | None, seq: int) -> float:
        """Keys per query the kernel computes: every block the mask does not leave empty, in whole blocks."""
        window = self.windows.get(kind) if kind else None
        bq, bk = min(self.block_q, seq), min(self.block_kv, seq)
        blocks = 0
        for qb in range(math.ceil(seq / bq)):
            q_lo, q_hi = qb * bq, min(seq, (qb + 1) * bq) - 1
            k_lo = 0 if window is None else max(0, q_lo - window + 1)
            blocks += q_hi // bk - k_lo // bk + 1
        return blocks * bk * bq / seq


@dataclass
class ExpertBlocks:
    """What the compiled program cannot say about the experts' block loops (olmax.model.moe.gmm): a loop over
    one expert's blocks of rows runs as many times as that expert has blocks, which is data. The model takes the
    routing's expectation from the config: balanced routing gives every expert tokens x top_k / experts rows, in
    whole blocks; random routing the same on average."""

    rows_per_expert: float  # rows one device's expert gets a micro-step, expected
    block: int  # rows a block
    routing: str  # the config's routing, said with the count
    scope: str  # the named scope the loops run under (olmax.model.moe.gmm.BLOCK_LOOP)
    # rows a device sends its expert group in one ragged exchange, expected (its tokens x the peers holding any of
    # a token's experts); a ragged-all-to-all moves these, not its static buffer. None: no ragged exchange.
    exchanged_rows: float | None = None
    # a bounded dropless exchange (impl.moe.ep_buffer): the assignments a device receives a micro-step, expected,
    # those its buffer takes a round, and the scope of its loops over the rounds past the first
    # (olmax.parallel.expert.rounds), which run while a device has assignments left
    received_assignments: float | None = None
    buffer_slots: int | None = None
    overflow_scope: str = ""

    @property
    def trips(self) -> int:
        return math.ceil(self.rows_per_expert / self.block)

    @property
    def overflow_trips(self) -> int:
        """The rounds past the first the expected routing takes."""
        return max(0, math.ceil(self.received_assignments / self.buffer_slots) - 1)

    def overflow_basis(self) -> str:
        return (f"{self.received_assignments:,.0f} assignments a device receives an exchange (its tokens x top_k; "
                f"{self.routing} routing taken as balanced) in rounds of {self.buffer_slots:,}")

    def basis(self) -> str:
        return (f"{self.rows_per_expert:,.0f} rows an expert (a device's tokens x top_k / its experts; {self.routing} "
                f"routing taken as balanced) in blocks of {self.block}")


MATMULS = {"fwd": 2, "dq": 3, "dkv": 4, "bwd": 5}  # per attention kernel: Splash's three, cuDNN's backward


def _attention_kernel(name: str, target: str, instruction: hlo.Instruction, operands: list[hlo.Array],
                      kind: str | None, attention: AttentionInfo | None, hw: Hardware) -> Cost | None:
    if target == "tpu_custom_call":
        found = re.match(r"splash_m[hq]a_(fwd|dq|dkv)", name)
    else:
        found = re.match(r"__cudnn\$fmha\w*?(Backward)?$", target)
    if not found or attention is None:
        return None
    part = (found.group(1) or "fwd") if target == "tpu_custom_call" else ("bwd" if found.group(1) else "fwd")
    q = max((a for a in operands if len(a.dims) == 4), key=lambda a: math.prod(a.dims), default=None)
    if q is None:
        return None
    # q is [batch, heads, sequence, head_dim] for Splash, [batch, sequence, heads, head_dim] for cuDNN
    b, heads, seq, head_dim = (q.dims if target == "tpu_custom_call" else (q.dims[0], q.dims[2], q.dims[1], q.dims[3]))
    flops = 2.0 * MATMULS[part] * b * heads * seq * attention.attended(kind, seq) * head_dim
    # every product of the kernel contracts over or produces head_dim: it fills the unit as head_dim does
    seconds = _matmul_seconds(flops, q.dtype, seq, head_dim, head_dim, hw)
    moved = sum(a.bytes for a in operands if not a.on_chip) + sum(a.bytes for a in instruction.outputs)
    return Cost(max(seconds, moved / (hw.memory_bandwidth * hw.memory_efficiency)), "attention", flops, moved)


GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__onednn$matmul")
# custom calls that do no work of their own: a buffer's allocation, and libtpu's steps around an asynchronous call
# (the SparseCores' offloaded collectives), whose work is costed in the call
BOOKKEEPING = ("AllocateBuffer", "PrepareAsyncCallStart", "PrepareAsyncCallDone")
UNKNOWN_CYCLES = 2**63 - 1  # libtpu's estimated_cycles for an op it does not estimate (the SparseCores' fusions)


def kernel_name(instruction: hlo.Instruction, target: str) -> str:
    """A kernel's name as olmax.model.kernel_work looks it up: a Pallas call's (its op name ends NAME/pallas_call
    on every backend, or NAME/mpmd_map for a Mosaic GPU `plgpu.kernel`), else a TPU kernel's instruction name less
    its numeric suffix, else the call's target."""
    if found := re.search(r"([^/]+)/(?:pallas_call|mpmd_map)$", instruction.op_name):
        return found.group(1)
    if target == "tpu_custom_call":
        return re.sub(r"\.\d+$", "", instruction.name)
    return target


def frontend_attributes(instruction: hlo.Instruction) -> dict:
    value = instruction.attribute("frontend_attributes") or ""
    return dict(re.findall(r'(\w+)="([^"]*)"', value))


class ProgramCost:
    """Costs of a module's ops, memoised per instruction (a loop body's ops are costed once)."""

    def __init__(self, module: hlo.Module, hw: Hardware, coords: list[dict] | None,
                 attention: AttentionInfo | None = None, experts: ExpertBlocks | None = None):
        self.module, self.hw, self.coords, self.attention, self.experts = module, hw, coords or [], attention, experts
        self.n_devices = max(len(self.coords), 1)
        self._fusions: dict[str, tuple] = {}

    def operands(self, computation: hlo.Computation, instruction: hlo.Instruction) -> list[hlo.Array]:
        found = []
        for name in instruction.operands:
            source = computation.by_name.get(name)
            found += source.outputs if source is not None else []
        return found

    # -- fusions: their matmuls and the bytes they really read and write
    def _fused(self, name: str) -> tuple[float, float, int, int, int, str, bool]:
        """(matmul FLOPs, FLOP-weighted m, n, k, operand dtype, in attention) of a fused computation."""
        if name in self._fusions:
            return self._fusions[name]
        computation = self.module.computation(name)
        flops, shape, dtype = 0.0, (0, 0, 0), "bf16"
        for inner in computation.instructions if computation else []:
            found = None
            if inner.op == "convolution":
                found = convolution(inner, self.operands(computation, inner))
            elif inner.op == "dot":
                found = dot(inner, self.operands(computation, inner))
            elif inner.op == "fusion":
                sub = self._fused(inner.calls()[0])
                found = (sub[0], sub[1], sub[2], sub[3], sub[4]) if sub[0] else None
            if found and found[0] > 0:
                if found[0] > flops:
                    shape, dtype = found[1:4], found[4]
                flops += found[0]
        self._fusions[name] = (flops, *shape, dtype, False)
        return self._fusions[name]

    def _bytes(self, computation: hlo.Computation, instruction: hlo.Instruction) -> float:
        """Bytes an op moves to and from memory: its operands and outputs in HBM; a fused parameter that is only
        sliced counts the slices; an output updated in place (dynamic-update-slice) counts the update."""
        outputs = [a for a in instruction.outputs if not a.on_chip]
        inputs = self.operands(computation, instruction)
        if instruction.op == "fusion":
            fused = self.module.computation(instruction.calls()[0])
            if fused is not None:
                return self._fused_bytes(fused, inputs) + self._fused_output_bytes(fused, outputs)
        if instruction.op == "dynamic-update-slice" and len(inputs) > 1:
            return 2.0 * inputs[1].bytes
        if instruction.op in ("dynamic-slice", "slice", "gather"):
            return 2.0 * sum(a.bytes for a in outputs)
        return sum(a.bytes for a in inputs if not a.on_chip) + sum(a.bytes for a in outputs)

    @staticmethod
    def _fused_bytes(fused: hlo.Computation, inputs: list[hlo.Array]) -> float:
        users = collections.defaultdict(list)
        for inner in fused.instructions:
            for operand in inner.operands:
                users[operand].append(inner)
        total = 0.0
        params = [i for i in fused.instructions if i.op == "parameter"]
        for param in params:
            index = int(re.match(r"\d+", param.arguments).group()) if re.match(r"\d+", param.arguments) else 0
            array = inputs[index] if index < len(inputs) else (param.outputs or [None])[0]
            if array is None or array.on_chip:
                continue
            readers, views, todo = [], {param.name}, list(users.get(param.name, []))
            while todo:  # through the views of it (a bitcast moves nothing) to the ops that read it
                reader = todo.pop()
                if reader.op == "bitcast":
                    views.add(reader.name)
                    todo += users.get(reader.name, [])
                else:
                    readers.append(reader)
            if readers and all(r.op in ("dynamic-slice", "slice", "gather") for r in readers):
                total += sum(a.bytes for r in readers for a in r.outputs)
            elif readers and all(r.op == "dynamic-update-slice" and r.operands[0] in views for r in readers):
                continue  # updated in place: the update is counted with the output
            else:
                total += array.bytes
        return total

    @staticmethod
    def _fused_output_bytes(fused: hlo.Computation, outputs: list[hlo.Array]) -> float:
        root = fused.root
        roots = [fused.by_name.get(o) for o in root.operands] if root.op == "tuple" else [root]
        total = 0.0
        for array, source in zip(outputs, roots if len(roots) == len(outputs) else [None] * len(outputs)):
            if source is not None and source.op == "dynamic-update-slice" and len(source.operands) > 1:
                update = fused.by_name.get(source.operands[1])  # written in place; its inputs are counted as read
                total += sum(a.bytes for a in (update.outputs if update else [array]))
            else:
                total += array.bytes
        return total

    def compute(self, computation: hlo.Computation, instruction: hlo.Instruction, kind: str | None) -> Cost | None:
        """The cost of a compute op, or None for ops that cost nothing or are not compute."""
        op = instruction.op
        if op in FREE or op in ("while", "conditional", "call") or op.endswith("-done") or op.endswith("-start"):
            return None
        hw = self.hw
        moved = self._bytes(computation, instruction)
        cached = 0 < moved <= hw.cache_bytes
        memory_seconds = moved / (hw.cache_bandwidth if cached else hw.memory_bandwidth * hw.memory_efficiency)
        flops, matmul_seconds, category = 0.0, 0.0, "memory"
        found = None
        if op == "fusion":
            fused = self._fused(instruction.calls()[0])
            if fused[0]:
                found = fused[:5]
        elif op == "convolution":
            found = convolution(instruction, self.operands(computation, instruction))
        elif op == "dot":
            found = dot(instruction, self.operands(computation, instruction))
        elif op == "custom-call":
            target = (instruction.attribute("custom_call_target") or "").strip('"')
            operands = self.operands(computation, instruction)
            if (attention := _attention_kernel(instruction.name, target, instruction, operands, kind, self.attention,
                                               hw)) is not None:
                return Cost(attention.seconds + hw.op_overhead, "attention", attention.flops, attention.bytes)
            if target == "__cudnn$blockScaledDot" and len(operands) >= 2:
                # jax.nn.scaled_matmul's layout: lhs [batch, m, k], rhs [batch, n, k], out [batch, m, n]
                out, k = instruction.outputs[0], operands[0].dims[-1]
                found = (2.0 * math.prod(out.dims) * k, math.prod(out.dims[:-1]), out.dims[-1], k, operands[0].dtype)
            elif target in GEMM_TARGETS and len(operands) >= 2:
                config = instruction.backend_config
                numbers = (config.get("gemm_backend_config") or config).get("dot_dimension_numbers")
                found = dot(instruction, operands, numbers or {"lhs_contracting_dimensions": [len(operands[0].dims) - 1],
                                                             "rhs_contracting_dimensions": [0]})
            elif target in BOOKKEEPING:
                return None
            else:
                return self._kernel(instruction, target, operands)
        if found:
            flops = found[0]
            matmul_seconds = _gemm_seconds(flops, found[4], found[1], found[2], found[3], hw)
            category = "attention" if "/attention/" in f"{instruction.op_name}/" else "matmul"
        if (cycles := self._estimated_cycles(instruction)) is not None:  # libtpu's own estimate for this op
            roofline = max(matmul_seconds, memory_seconds) + hw.op_overhead
            return Cost(cycles / hw.clock, category, flops, moved, roofline=roofline)
        return Cost(max(matmul_seconds, memory_seconds) + hw.op_overhead, category, flops, moved)

    def _estimated_cycles(self, instruction: hlo.Instruction) -> int | None:
        """libtpu's estimated cycles for a TPU op, where the compiled program carries them and the chip's clock is
        known."""
        if not self.hw.clock:
            return None
        found = re.search(r'"estimated_cycles":"(\d+)"', instruction.attributes)
        return int(found.group(1)) if found and int(found.group(1)) != UNKNOWN_CYCLES else None

    def _kernel(self, instruction: hlo.Instruction, target: str, operands: list[hlo.Array]) -> Cost:
        """A kernel's cost from the work olmax.model.kernel_work registers for it; a kernel it does not know is
        costed by its bytes and counted by name (`unknown_kernel`)."""
        hw = self.hw
        name = kernel_name(instruction, target)
        moved = sum(a.bytes for a in operands if not a.on_chip) + sum(a.bytes for a in instruction.outputs)
        entry = kernel_work.lookup(name)
        if entry is None:
            return Cost(moved / (hw.memory_bandwidth * hw.memory_efficiency) + hw.op_overhead, "memory", 0.0, moved,
                        unknown_kernel=name)
        grid = tuple(int(v) for v in re.findall(r"grid_[xyz] = (\d+)", instruction.attributes)) or None
        per_group = self.experts.rows_per_expert if self.experts is not None else None
        work = entry(kernel_work.KernelCall(name, operands, instruction.outputs, grid, frontend_attributes(instruction),
                                            per_group))
        seconds = _matmul_seconds(work.flops, work.dtype, *work.tile, hw) if work.flops else 0.0
        return Cost(max(seconds, work.bytes / (hw.memory_bandwidth * hw.memory_efficiency)) + hw.op_overhead,
                    "matmul" if work.flops else "memory", work.flops, work.bytes)

    # -- collectives
    def collective(self, computation: hlo.Computation, instruction: hlo.Instruction, kind: str) -> Cost:
        """Its bytes a device: the larger of its inputs and its results (a tuple's arrays travel together); a
        ragged all-to-all's, the rows the routing sends (ExpertBlocks.exchanged_rows) at its operand's row size."""
        inputs = self.operands(computation, instruction)
        size = max(sum(a.bytes for a in inputs), sum(a.bytes for a in instruction.results(inputs)))
        if kind == "ragged-all-to-all" and self.experts is not None and self.experts.exchanged_rows is not None:
            rows = inputs[0]  # operand, output, then the offsets and sizes
            size = min(size, self.experts.exchanged_rows * rows.bytes / max(rows.dims[0], 1))
        groups = hlo.replica_groups(instruction, self.n_devices)
        return Cost(collective_seconds(kind, size, groups[0], self.coords, self.hw), kind, 0.0, size)


def collective_seconds(kind: str, size: float, group: list[int], coords: list[dict], hw: Hardware) -> float:
    """A collective's time on the target's links: `size` bytes per device (the larger of its input and
    output), the group's members (partition ids) located by `coords`."""
    n = len(group)
    if n <= 1 or size == 0:
        return 0.0
    if hw.platform == "tpu":
        ring, link, spread = _torus(group, coords, hw)
    elif hw.platform == "gpu":
        ring, link, spread = _gpu(group, coords, hw)
    else:
        ring, link, spread = hw.memory_bandwidth, hw.memory_bandwidth, 1.0
    ring, link = ring * hw.collective_efficiency, link * hw.collective_efficiency
    share = (n - 1) / n
    if kind == "all-reduce":
        seconds = 2 * share * size / ring  # reduce-scatter, then all-gather
    elif kind in ("all-gather", "reduce-scatter", "collective-broadcast"):
        seconds = share * size / ring
    elif kind in ("all-to-all", "ragged-all-to-all"):
        seconds = size * spread / link
    else:  # collective-permute: each device sends its buffer over one link
        seconds = size / link
    return seconds + hw.collective_latency


def _torus(group: list[int], coords: list[dict], hw: Hardware) -> tuple[float, float, float]:
    """(bytes/s a device puts into the group's rings, one link's bytes/s, all-to-all's bytes per link per byte
    sent) on a TPU slice. The group's members differ along some torus dimensions; each spanned dimension is a
    ring both ways round with wraparound (two links a device), a line without (one); all spanned dimensions
    run at once; a chip's links are shared by its devices. All-to-all is bound by the cut through the largest
    spanned dimension of size k: half the devices send half their data across it, over 2 n / k links each
    way with wraparound (half as many without): k B / (8 L), or k B / (4 L)."""
    points = [coords[i] for i in group] if coords else []
    spanned = [len({p.get(dim) for p in points}) for dim in ("x", "y", "z")]
    spanned = [size for size in spanned if size > 1]
    link = hw.link_bandwidth / hw.devices_per_chip
    if not spanned:  # the devices of one chip: the die-to-die link is not the bottleneck
        return hw.memory_bandwidth, hw.memory_bandwidth, 1.0
    ways = 2 if hw.wraparound else 1
    return link * ways * len(spanned), link, max(spanned) / (4 * ways)


def _gpu(group: list[int], coords: list[dict], hw: Hardware) -> tuple[float, float, float]:
    """(ring bytes/s per device, one link's, all-to-all's share sent over it) on GPU hosts: NVLink inside a
    host (through its switches: every GPU at its full NVLink rate), the network between hosts (one NIC a
    GPU): a ring across hosts runs at the NIC's rate, an all-to-all sends over the network what leaves the
    host."""
    hosts = {coords[i].get("host", i // hw.devices_per_host) if coords else i // hw.devices_per_host for i in group}
    n = len(group)
    if len(hosts) == 1:
        return hw.link_bandwidth, hw.link_bandwidth, (n - 1) / n
    local = n / len(hosts)
    return hw.network_bandwidth, hw.network_bandwidth, (n - local) / n


# --- the schedule -------------------------------------------------------------------------------------------------

LAYER = re.compile(r"[/(]layer(\d+)\.(\w+)[/)]")


def layer_of(instruction: hlo.Instruction) -> tuple[str | None, str | None]:
    """(layer label, layer kind) from the op's name, as the model's named scopes wrote it: a path part under a
    scan (`.../layer3.global/...`), a transform's argument where the layers are unrolled (`jvp(layer3.global)`)."""
    found = LAYER.search(f"/{instruction.op_name}/")
    if found:
        return f"layer{found.group(1)}.{found.group(2)}", found.group(2)
    return None, None


def region_of(instruction: hlo.Instruction, layer_kind: str | None) -> str:
    """What a layer-less op belongs to: the loss and LM head or embedding (inside the loss function), or the
    optimizer update and gradient reduction (outside it)."""
    if layer_kind:
        return layer_kind
    name = instruction.op_name
    if not name:
        return "other"
    return "embedding and head" if "closed_call" in name else "optimizer and gradients"


def op_group(module: hlo.Module, instruction: hlo.Instruction, region: str) -> str:
    """What an op is, for the table of where a step's time goes: its region, its pass (forward, backward, or the
    forward recomputed for the backward), the last part of its op name (the JAX operation or named scope that made
    it) and, for a fusion, what the fused computation ends in."""
    name = instruction.op_name
    if "rematted_computation" in name:
        step = "recomputed"
    elif "transpose(" in name:
        step = "backward"
    elif "jvp(" in name:
        step = "forward"
    else:
        step = ""
    parts = [p for p in name.split("/") if p and not re.fullmatch(r"(jit|jvp|transpose|vmap)\(.*\)|while|body|"
                                                                 r"closed_call|checkpoint|rematted_computation|"
                                                                 r"layer\d+\.\w+|jit\(\w+\)", p)]
    what = re.sub(r"_tile_m=[^/]*", "", "/".join(parts[-2:])) or instruction.op  # a kernel's name less its tiles
    if instruction.op == "fusion" and instruction.calls():
        fused = module.computation(instruction.calls()[0])
        if fused is not None and fused.instructions:
            what += f" ({fused.root.op} fusion)"
    elif instruction.op not in what:
        what += f" ({instruction.op})"
    return f"{region}{' ' + step if step else ''}: {what}"


@dataclass
class Tally:
    """Seconds by (category, region), exposed collective seconds, hidden collective seconds, FLOPs."""

    seconds: dict = field(default_factory=lambda: collections.defaultdict(float))
    hidden: float = 0.0
    collective_seconds: float = 0.0
    collective_bytes: dict = field(default_factory=lambda: collections.defaultdict(float))
    flops: float = 0.0
    ops: float = 0.0  # compute ops launched a step (a loop's body's as often as it runs)
    derived_loops: dict = field(default_factory=dict)  # while op -> (its scope, the trips assumed, why)
    uncounted_loops: dict = field(default_factory=dict)  # while op -> its op name: no count derivable, counted once
    unknown_kernels: dict = field(default_factory=lambda: collections.defaultdict(float))  # name -> calls a step
    estimated_ops: set = field(default_factory=set)  # ops costed at libtpu's estimated cycles
    estimated_seconds: float = 0.0  # their seconds a step at those cycles
    roofline_seconds: float = 0.0  # and at the roofline
    total: float = 0.0  # the step's seconds
    timeline_cut: float = math.inf  # where the timeline stops, when a step has more events than it keeps
    events: list = field(default_factory=list)  # (start, end, lane, category, label) of the timeline
    groups: dict = field(default_factory=lambda: collections.defaultdict(lambda: [0.0, 0.0]))  # (category, op_group) -> [seconds, ops]


COSTLIEST = 20  # op groups the prediction lists, by their seconds a step


@dataclass
class Clock:
    compute: float = 0.0  # when the compute stream is free
    links: float = 0.0  # when the collective stream is free
    copies: float = 0.0  # when the asynchronous copy engine is free
    pending: dict = field(default_factory=dict)  # async op name -> (start, finish, kind: a collective's or copy)
    order: list = field(default_factory=list)  # pending names in start order


class Simulator:
    def __init__(self, cost: ProgramCost, keep_events: int = 200_000):
        self.cost, self.keep_events = cost, keep_events
        self.module = cost.module

    def run(self) -> Tally:
        tally = Tally()
        clock = Clock()
        self._computation(self.module.computation(self.module.entry), clock, tally, 1.0, record=True)
        tally.total = clock.compute
        return tally

    def _event(self, tally, record, start, end, lane, category, label):
        if record and end > start and len(tally.events) >= self.keep_events:
            tally.timeline_cut = min(tally.timeline_cut, start)
        elif record and end > start:
            last = tally.events[-1] if tally.events else None
            if last and last[2] == lane and last[3] == category and last[4] == label and abs(last[1] - start) < 1e-12:
                tally.events[-1] = (last[0], end, lane, category, label)
            else:
                tally.events.append((start, end, lane, category, label))

    def _computation(self, computation: hlo.Computation, clock: Clock, tally: Tally, weight: float, record: bool,
                     region: str | None = None, layer: str | None = None, kind: str | None = None):
        """Ops without an op name (the partitioner's collectives, kernels' custom calls) belong to the layer of the
        op before them."""
        for instruction in computation.instructions:
            label, found = layer_of(instruction)
            if label or instruction.op_name:
                layer, kind = label, found
                region = region_of(instruction, kind)
            self._instruction(computation, instruction, clock, tally, weight, record, region or "other", layer, kind)

    def _instruction(self, computation, instruction, clock, tally, weight, record, region, layer, kind):
        op = instruction.op
        module = self.module
        if op == "while":
            body = module.computation((instruction.attribute("body") or "").lstrip("%"))
            trips = module.trip_count(instruction, computation)
            if body is None:
                return
            if trips is None:  # bounded by data: the routing's expectation for the experts' block loops
                trips = self._derived_trips(instruction, tally)
            if trips == 0:
                return
            self._computation(body, clock, tally, weight, record, region, layer)
            if trips > 1:
                mark = len(tally.events)
                second_start = clock.compute
                self._computation(body, clock, tally, weight * (trips - 1), record, region, layer)
                per = clock.compute - second_start
                if record:  # the timeline shows every iteration: the second's events again, shifted
                    repeat = tally.events[mark:]
                    for t in range(1, trips - 1):
                        for (s, e, lane, cat, lab) in repeat:
                            self._event(tally, True, s + t * per, e + t * per, lane, cat, lab)
                shift = per * (trips - 2)  # the iterations after the second, which take as long
                clock.compute += shift
                clock.links += shift
                clock.copies += shift
                clock.pending = {k: (a + shift, b + shift, c) for k, (a, b, c) in clock.pending.items()}
            return
        if op in ("call", "conditional") and not op.endswith("-start"):
            called = [module.computation(c) for c in instruction.calls()]
            called = [c for c in called if c is not None]
            if op == "conditional" and called:
                # the longest branch: simulate each on a copy of the clock, keep the slowest
                best = None
                for branch in called:
                    trial = Clock(clock.compute, clock.links, clock.copies, dict(clock.pending), list(clock.order))
                    scratch = Tally()
                    self._computation(branch, trial, scratch, weight, False, region, layer)
                    if best is None or trial.compute > best[0].compute:
                        best = (trial, branch)
                self._computation(best[1], clock, tally, weight, record, region, layer)
                return
            for callee in called:
                self._computation(callee, clock, tally, weight, record, region, layer)
            return
        kind_name = op.removesuffix("-start")
        if op.endswith("-start") or op == "async-start":
            self._start(computation, instruction, clock, tally, weight, record, region, layer)
            return
        if op.endswith("-done") or op == "async-done":
            self._done(instruction, clock, tally, weight, record, region, layer)
            return
        if kind_name in COLLECTIVES:  # synchronous: the compute waits for it
            cost = self.cost.collective(computation, instruction, kind_name)
            start = max(clock.compute, clock.links)
            end = start + cost.seconds
            self._exposed(tally, weight, end - clock.compute, region, kind_name)
            tally.collective_seconds += weight * cost.seconds
            tally.collective_bytes[kind_name] += weight * cost.bytes
            self._event(tally, record, start, end, "links", "exposed", layer or region)
            clock.compute = clock.links = end
            return
        cost = self.cost.compute(computation, instruction, kind)
        if cost is None:
            return
        if cost.unknown_kernel:
            tally.unknown_kernels[cost.unknown_kernel] += weight
        if cost.roofline is not None:
            tally.estimated_ops.add(instruction.name)
            tally.estimated_seconds += weight * cost.seconds
            tally.roofline_seconds += weight * cost.roofline
        start = clock.compute
        clock.compute += cost.seconds
        tally.seconds[(cost.category, region)] += weight * cost.seconds
        tally.flops += weight * cost.flops
        tally.ops += weight
        group = tally.groups[(cost.category, op_group(self.module, instruction, region))]
        group[0] += weight * cost.seconds
        group[1] += weight
        self._event(tally, record, start, clock.compute, "compute", cost.category, layer or region)

    @staticmethod
    def _exposed(tally, weight, seconds, region, kind):
        """Seconds the compute waited for a collective (or an asynchronous copy): in its region's exposed
        collectives, and in the op groups as the collective's kind, exposed."""
        tally.seconds[("collective", region)] += weight * seconds
        group = tally.groups[("collective", f"{region}: {kind} (exposed)")]
        group[0] += weight * seconds
        group[1] += weight

    def _derived_trips(self, loop: hlo.Instruction, tally: Tally) -> int:
        """The trip count of a loop the compiled program does not state: an expert block loop's from the
        routing's expectation (ExpertBlocks), and so the rounds of a bounded exchange past its first; any other
        loop's cannot be derived: it counts once, and is named."""
        experts = self.cost.experts
        if experts is not None and f"/{experts.scope}/" in f"/{loop.op_name}/":
            tally.derived_loops[loop.name] = (experts.scope, experts.trips, experts.basis())
            return experts.trips
        if experts is not None and experts.buffer_slots and f"/{experts.overflow_scope}/" in f"/{loop.op_name}/":
            tally.derived_loops[loop.name] = (experts.overflow_scope, experts.overflow_trips, experts.overflow_basis())
            return experts.overflow_trips
        tally.uncounted_loops[loop.name] = loop.op_name or loop.name
        return 1

    def _async_kind(self, instruction: hlo.Instruction) -> tuple[str, hlo.Computation | None, hlo.Instruction | None]:
        """(collective kind or 'copy' or 'call', the computation and instruction that does the work)."""
        op = instruction.op
        if op in ("async-start", "call-start"):
            called = self.module.computation(instruction.calls()[0]) if instruction.calls() else None
            if called is not None:
                root = called.root
                kind = root.op.removesuffix("-start")
                if kind in COLLECTIVES:
                    return kind, called, root
                return "call", called, root
            return "call", None, None
        kind = op.removesuffix("-start")
        return (kind if kind in COLLECTIVES else "copy"), None, instruction

    def _start(self, computation, instruction, clock, tally, weight, record, region, layer):
        kind, inner_computation, inner = self._async_kind(instruction)
        if kind in COLLECTIVES:
            cost = self.cost.collective(inner_computation or computation, inner, kind)
            start = max(clock.compute, clock.links)
            clock.links = start + cost.seconds
            finish = clock.links
            tally.collective_seconds += weight * cost.seconds
            tally.collective_bytes[kind] += weight * cost.bytes
        elif kind == "call" and inner_computation is not None:
            # work on another engine (the SparseCores' offloaded collectives): its own clock
            trial = Clock(max(clock.compute, clock.links), clock.links, clock.copies)
            scratch = Tally()
            Simulator(self.cost)._computation(inner_computation, trial, scratch, 1.0, False, region, layer)
            finish = trial.compute
            start = max(clock.compute, clock.links)
            tally.collective_seconds += weight * (finish - trial.links)
            clock.links = finish
        else:  # an asynchronous copy (memory space, host offload): the copy engine at HBM bandwidth
            moved = sum(a.bytes for a in self.cost.operands(computation, instruction))
            start = max(clock.compute, clock.copies)
            clock.copies = start + moved / (self.cost.hw.memory_bandwidth * self.cost.hw.memory_efficiency)
            finish = clock.copies
        clock.pending[instruction.name] = (start, finish, kind)
        clock.order.append(instruction.name)

    def _done(self, instruction, clock, tally, weight, record, region, layer):
        name = next((o for o in instruction.operands if o in clock.pending), None)
        if name is None:  # started in an earlier loop iteration, passed through the loop's tuple: the oldest alike
            kind = instruction.op.removesuffix("-done")
            name = next((n for n in clock.order if clock.pending[n][2] == kind or
                         (kind == "async" and clock.pending[n][2] != "copy")), None)
        if name is None:
            return
        start, finish, kind = clock.pending.pop(name)
        on_links = kind != "copy"
        clock.order.remove(name)
        if on_links:  # the timeline's links lane: hidden while the compute went on, exposed while it waited
            self._event(tally, record, start, min(finish, clock.compute), "links", "hidden", layer or region)
        if finish > clock.compute:
            self._exposed(tally, weight, finish - clock.compute, region, kind)
            if on_links:
                self._event(tally, record, clock.compute, finish, "links", "exposed", layer or region)
            clock.compute = finish


# --- the prediction -------------------------------------------------------------------------------------------------

def target_hardware(target) -> Hardware:
    """The model's view of one device of a target (olmax.scale.targets.Target): its datasheet constants."""
    from olmax.scale.targets import (COLLECTIVE_EFFICIENCY, COLLECTIVE_LATENCY, GPUS_PER_HOST, HBM_EFFICIENCY,
                                      OP_OVERHEAD)

    a = target.accelerator
    per_device = 1 / a.devices_per_chip
    dims = [int(d) for d in target.topology.split("x")]
    if a.platform == "tpu":
        # wraparound links close a slice's dimensions into rings on whole cubes of 4x4x4 (3D) or the whole 16x16
        # pod (2D); smaller slices are meshes
        wrap = all(d % 4 == 0 for d in dims) if a.torus_dimensions == 3 else all(d == 16 for d in dims)
        topology = dict(torus=tuple(dims), wraparound=wrap, devices_per_chip=a.devices_per_chip)
    else:
        topology = dict(hosts=dims[1], devices_per_host=min(GPUS_PER_HOST, target.chips))
    return Hardware(
        name=target.name, platform=a.platform,
        matmul_flops={"bf16": a.peak_flops_per_chip * per_device, "f8": a.fp8_flops_per_chip * per_device,
                      "f16": a.peak_flops_per_chip * per_device,
                      # float32 operands: one bf16 pass on a TPU (XLA's default precision), TF32 (half) on a GPU
                      "f32": a.peak_flops_per_chip * per_device * (1.0 if a.platform == "tpu" else 0.5)},
        matmul_efficiency=a.matmul_efficiency, memory_bandwidth=a.memory_bandwidth * per_device,
        memory_efficiency=HBM_EFFICIENCY, tile=a.matrix_tile, link_bandwidth=a.link_bandwidth,
        network_bandwidth=a.network_bandwidth, collective_efficiency=COLLECTIVE_EFFICIENCY,
        collective_latency=COLLECTIVE_LATENCY[a.platform], op_overhead=OP_OVERHEAD[a.platform],
        gemm_table=a.gemm_table, clock=a.clock, **topology)


def _downsample(events: list, total: float, limit: int = 4000) -> list:
    """At most `limit` timeline events: neighbours on one lane with one category and label merged when short."""
    if len(events) <= limit:
        return events
    quantum = total / limit
    merged = []
    for event in sorted(events, key=lambda e: (e[2], e[0])):
        last = merged[-1] if merged else None
        if last and last[2] == event[2] and last[3] == event[3] and event[0] - last[1] < quantum:
            merged[-1] = (last[0], max(last[1], event[1]), last[2], last[3], last[4])
        else:
            merged.append(event)
    return sorted(merged, key=lambda e: e[0])[: limit * 2]


def predict(text: str, hw: Hardware, coords: list[dict] | None = None, attention: AttentionInfo | None = None,
            model_flops_per_device: float | None = None, experts: ExpertBlocks | None = None) -> dict:
    """The predicted step of the compiled program `text` (optimized HLO) on `hw`: its time, where the time goes,
    and, given the model's FLOPs per device and step, the MFU those FLOPs make of the device's peak.

    `loops` lists the loops whose trip count the model derived (the program does not state it) with the count
    it assumed; `warnings` names what the model could not count: a loop without a derivable trip count (counted
    once) and a custom call it does not know (costed by its bytes only, `unknown_kernels` by calls a step).
    `libtpu_estimate`: the ops costed at libtpu's own cycle estimate, what the roofline gives for them, and the
    step with them at the roofline; where the two steps are more than SPREAD apart, `step_range` is both (shortest
    first), and `step_seconds` still the one at libtpu's estimate."""
    module = hlo.Module(text)
    simulator = Simulator(ProgramCost(module, hw, coords, attention, experts))
    tally = simulator.run()
    loops = collections.defaultdict(lambda: {"loops": 0})
    for scope, trips, basis in tally.derived_loops.values():
        loops[(scope, trips, basis)]["loops"] += 1
    warnings = [f"loop {name} ({op_name}): its trip count is data the model cannot derive; counted once"
                for name, op_name in sorted(tally.uncounted_loops.items())]
    warnings += [f"custom call {name} ({calls:,.0f} a step): an unknown kernel, costed by its bytes only (register "
                 "its work in olmax.model.kernel_work)" for name, calls in sorted(tally.unknown_kernels.items())]
    step = tally.total
    by_category = collections.defaultdict(float)
    by_region = collections.defaultdict(lambda: collections.defaultdict(float))
    for (category, region), seconds in tally.seconds.items():
        by_category[category] += seconds
        by_region[region][category] += seconds
    peak = hw.matmul_flops["bf16"]
    report = {
        "hardware": hw.name,
        "step_seconds": step,
        "seconds": {c: by_category.get(c, 0.0) for c in CATEGORIES},
        "collectives": {"total_seconds": tally.collective_seconds, "exposed_seconds": by_category.get("collective", 0.0),
                        "hidden_seconds": max(tally.collective_seconds - by_category.get("collective", 0.0), 0.0),
                        "bytes_by_kind": dict(tally.collective_bytes)},
        "by_region": {r: {c: v.get(c, 0.0) for c in CATEGORIES} for r, v in sorted(by_region.items())},
        "executed_flops": tally.flops,
        "executed_ops": tally.ops,
        "costliest": [{"category": category, "group": group, "seconds": seconds, "ops": ops}
                      for (category, group), (seconds, ops) in sorted(tally.groups.items(), key=lambda kv: -kv[1][0])
                      [:COSTLIEST]],
        "loops": [{"scope": scope, "trips": trips, "basis": basis, **v} for (scope, trips, basis), v in loops.items()],
        "warnings": warnings,
        "unknown_kernels": dict(tally.unknown_kernels),
        "constants": {"matmul_efficiency": hw.matmul_efficiency, "memory_efficiency": hw.memory_efficiency,
                      "collective_efficiency": hw.collective_efficiency, "peak_flops_per_device": peak,
                      "memory_bandwidth_per_device": hw.memory_bandwidth, "gemm_table": hw.gemm_table,
                      "clock": hw.clock},
        "timeline": [{"start": s, "end": e, "lane": lane, "category": c, "label": label}
                     for s, e, lane, c, label in _downsample(tally.events, step)],
        "timeline_until": min(tally.timeline_cut, step),
    }
    if tally.estimated_ops:
        # the same step with those ops at the roofline: the other prediction, which the point figure does not follow
        roofline = Simulator(ProgramCost(module, dataclasses.replace(hw, clock=0.0), coords, attention, experts),
                             keep_events=0).run().total
        report["libtpu_estimate"] = {"ops": len(tally.estimated_ops), "seconds": tally.estimated_seconds,
                                     "roofline_seconds": tally.roofline_seconds, "clock": hw.clock,
                                     "roofline_step_seconds": roofline}
        if step and max(step, roofline) > (1 + SPREAD) * min(step, roofline):
            report["step_range"] = [min(step, roofline), max(step, roofline)]
    if model_flops_per_device:
        report["model_flops_per_device"] = model_flops_per_device
        report["mfu"] = model_flops_per_device / (step * peak) if step else None
    return report


def matmul_rate(constants: dict) -> str:
    """In words, the rate a prediction's matmuls were costed at."""
    k = constants
    if k.get("gemm_table"):
        return (f"matmuls at XLA's measured rate for their shape and dtype ({k['gemm_table']} GEMM table; "
                f"{k['matmul_efficiency']:.0%} of the {k['peak_flops_per_device'] / 1e12:,.0f} TFLOP/s peak at "
                "the largest shapes)")
    estimate = (f"; ops libtpu estimates, at its estimated cycles ({k['clock'] / 1e9:.3f} GHz)" if k.get("clock")
                else "")
    return (f"matmuls at {k['matmul_efficiency']:.0%} of the {k['peak_flops_per_device'] / 1e12:,.0f} TFLOP/s peak, "
            f"derated where their dimensions do not fill the unit{estimate}")


def range_line(prediction: dict) -> str | None:
    """The predicted step as the range of its two predictions, in words, where it has one (`step_range`): the step
    and its MFU at each end, and which the point figure follows."""
    if not prediction.get("step_range"):
        return None
    from olmax.figures import figure, percent

    estimate, step = prediction["libtpu_estimate"], prediction["step_seconds"]
    (low, high), roofline = prediction["step_range"], estimate["roofline_step_seconds"]
    scale, unit = next(((scale, unit) for scale, unit in ((1.0, "s"), (1e-3, "ms")) if low >= scale), (1e-6, "us"))
    mfu = [f"{percent(prediction[key] * step / high)}-{percent(prediction[key] * step / low)}{count}"
           for key, count in (("mfu", " (exact count)"), ("mfu_all_global", " (every layer global)")) if prediction.get(key)]
    return (f"predicted step {figure(low / scale)}-{figure(high / scale)} {unit}"
            f"{', MFU ' + ', '.join(mfu) if mfu else ''}: {figure(step / scale)} {unit} with its {estimate['ops']:,} "
            f"ops at libtpu's estimated cycles, {figure(roofline / scale)} {unit} with them at the roofline, "
            f"{max(step, roofline) / min(step, roofline) - 1:.0%} apart; the point figure follows libtpu's estimate")


def notes(prediction: dict) -> list[str]:
    """What a prediction assumed and could not count, in words: the loops whose trip counts it derived, libtpu's
    estimate against the roofline, and its warnings."""
    lines = [f"{loop['loops']} {loop['scope']} loops at {loop['trips']} trips each: {loop['basis']}"
             for loop in prediction.get("loops", [])]
    if estimate := prediction.get("libtpu_estimate"):
        lines.append(f"{estimate['ops']:,} ops at libtpu's estimated cycles: {estimate['seconds']:.4g} s a step, "
                     f"where the roofline gives them {estimate['roofline_seconds']:.4g} s")
    return lines + [f"warning: {w}" for w in prediction.get("warnings", [])]


def measure_cpu(repeats: int = 7) -> Hardware:
    """This machine's CPU as the model sees it, measured now (each figure the best of `repeats`): the matmul
    rate of a 1024^3 float32 and bfloat16 matmul; the bandwidth of an elementwise pass over 256 MiB (memory)
    and over 4 MiB (its last-level cache, whose size sysfs gives); the cost of one op inside a compiled program
    (a chain of 257 small matmuls against a chain of 1)."""
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp

    def best(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return min(times)

    rates = {}
    for dtype in ("f32", "bf16"):
        a = jnp.ones((1024, 1024), {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype])
        rates[dtype] = 2 * 1024**3 / best(jax.jit(jnp.matmul), a, a)
    double = jax.jit(lambda x: x * 2.0)
    bandwidth = {}
    for size in (2**20, 64 * 2**20):  # float32 elements: 4 MiB, 256 MiB
        x = jnp.ones((size,), jnp.float32)
        bandwidth[size] = 2 * x.nbytes / best(double, x)

    def chain(n):
        def run(x):
            for _ in range(n):
                x = jnp.tanh(x @ x)
            return x
        return jax.jit(run)

    small = jnp.full((8, 8), 0.1, jnp.float32)
    per_op = max((best(chain(257), small) - best(chain(1), small)) / 256, 0.0)
    sizes = [Path(p).read_text().strip() for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    cache = max((int(v[:-1]) * {"K": 2**10, "M": 2**20}[v[-1]] for v in sizes if v[-1] in "KM"), default=0)
    return Hardware(name="this CPU", platform="cpu", matmul_flops={"f32": rates["f32"], "bf16": rates["bf16"],
                                                                   "f16": rates["bf16"]},
                    matmul_efficiency=1.0, memory_bandwidth=bandwidth[64 * 2**20], memory_efficiency=1.0,
                    tile=(1, 1, 1), op_overhead=per_op, cache_bytes=cache, cache_bandwidth=bandwidth[2**20])
