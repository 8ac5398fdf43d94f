"""What one op of a compiled program costs on one device (`ProgramCost`), the step-time model's unit:

- compute (fusions, matmuls, kernels, copies): the larger of its FLOPs at the matrix unit's rate and its
  bytes at the memory's bandwidth. On a GPU a matmul's rate is what XLA's measured GEMM table gives its shape
  and dtype (olmax.scale.hardware.gemm_rate); elsewhere the device's peak for its operands' dtype, times the
  hardware's achievable fraction (`Hardware.matmul_efficiency`), times how well its dimensions fill the matrix
  unit's tile (a contraction of 128 on a 256-wide systolic array runs at half the rate). On a TPU whose clock is
  known (v5p) an op the compiler estimated takes libtpu's estimated cycles instead (`Cost.roofline` keeps what
  the roofline gives it). Attention kernels (Splash on TPU, cuDNN's on GPU) are costed from their shapes, the
  blocks their mask leaves (`AttentionInfo`), and the matmuls each of them runs (forward 2, Splash's dq 3 and
  dkv 4, cuDNN's backward 5); any other kernel from the work olmax.model.kernel_registry holds for it (the TPU's
  ragged-dot grouped matmuls, olmax's grouped GPU kernels), and one it does not know by its bytes, named
  (`Cost.unknown_kernel`).
- collectives: their bytes per device over the links the group spans, with the algorithm the platform uses
  (a bidirectional ring per torus dimension, all dimensions at once on a TPU slice with wraparound; NVLink
  within a GPU host and the hosts' network between them; all-to-all by the bisection); a ragged all-to-all by
  the rows the routing is expected to send (`ExpertBlocks`).
"""

from __future__ import annotations

import collections
import math
import re
from dataclasses import dataclass

from olmax.model import kernel_work
from olmax.scale import hlo
from olmax.scale.hardware import Hardware, gemm_rate

FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
        "opt-barrier", "add-dependency", "domain", "iota"}


@dataclass
class Cost:
    seconds: float
    category: str  # matmul, attention, memory (compute) or a collective's kind
    flops: float = 0.0
    bytes: float = 0.0
    roofline: float | None = None  # the roofline's seconds, where `seconds` are libtpu's estimate instead
    unknown_kernel: str | None = None  # a custom call the model does not know, costed by its bytes
    # a kernel's seconds under each assumption its range spans (KERNEL_ENDS), where they differ; `seconds` is one
    # of them (ProgramCost's `kernels`)
    kernel_ends: dict | None = None


# What a kernel's time assumes, each end of its range: its tiles' re-reads served by L2 (each operand moved across
# HBM once) or each tile load from HBM; its matmuls at cuBLAS's rate for its tiles or at its design's fraction of
# that (olmax.model.kernel_work.OF_CUBLAS).
KERNEL_ENDS = {"fast": ("L2", "cuBLAS"), "hbm": ("HBM", "cuBLAS"), "own_rate": ("L2", "own"), "slow": ("HBM", "own")}


# --- compute ops --------------------------------------------------------------------------------------------------

def _fill(size: int, tile: int) -> float:
    """How much of a matrix unit's `tile`-wide dimension `size` fills, on average over the tiles it takes."""
    return size / (math.ceil(size / tile) * tile) if size else 1.0



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
    """What the compiled program cannot say about the experts' block loops (olmax.model.moe.block_loop): a loop over
    one expert's blocks of rows runs as many times as that expert has blocks, which is data. The model takes the
    routing's expectation from the config: balanced routing gives every expert tokens x top_k / experts rows, in
    whole blocks; random routing the same on average."""

    rows_per_expert: float  # rows one device's expert gets a micro-step, expected
    block: int  # rows a block
    routing: str  # the config's routing, said with the count
    scope: str  # the named scope the loops run under (olmax.model.moe.block_loop.BLOCK_LOOP)
    # rows a device sends its expert group in one ragged exchange, expected (its tokens x the peers holding any of
    # a token's experts); a ragged-all-to-all moves these, not its static buffer. None: no ragged exchange.
    exchanged_rows: float | None = None
    # a bounded dropless exchange (impl.moe.ep_buffer): the assignments a device receives a micro-step, expected,
    # those its buffer takes a round, and the scope of its loops over the rounds past the first
    # (olmax.parallel.expert.rounds), which run while a device has assignments left
    received_assignments: float | None = None
    buffer_slots: int | None = None
    overflow_scope: str = ""
    # the routing's distribution of a device's rows over its experts, for the grouped kernels that run the rows
    # routed (their padding, the busiest device); None: they cost their whole buffer
    routed: kernel_work.RoutedRows | None = None

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
    """A kernel's name as olmax.model.kernel_registry looks it up: a Pallas call's (its op name ends NAME/pallas_call
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
                 attention: AttentionInfo | None = None, experts: ExpertBlocks | None = None, kernels: str = "fast"):
        """`kernels`: which end of the kernels' ranges (KERNEL_ENDS) their seconds take."""
        self.module, self.hw, self.coords, self.attention, self.experts = module, hw, coords or [], attention, experts
        self.kernels = kernels
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
        """A kernel's cost from the work olmax.model.kernel_registry holds for it; a kernel it does not know is
        costed by its bytes and counted by name (`unknown_kernel`)."""
        # Imported at the first kernel costed: the registry imports the kernels' modules, and with them JAX, which
        # the pages that only read a prediction (olmax report) do not load.
        from olmax.model import kernel_registry

        hw = self.hw
        name = kernel_name(instruction, target)
        moved = sum(a.bytes for a in operands if not a.on_chip) + sum(a.bytes for a in instruction.outputs)
        entry = kernel_registry.lookup(name)
        if entry is None:
            return Cost(moved / (hw.memory_bandwidth * hw.memory_efficiency) + hw.op_overhead, "memory", 0.0, moved,
                        unknown_kernel=name)
        grid = tuple(int(v) for v in re.findall(r"grid_[xyz] = (\d+)", instruction.attributes)) or None
        routed = self.experts.routed if self.experts is not None else None
        work = entry(kernel_work.KernelCall(name, operands, instruction.outputs, grid, frontend_attributes(instruction),
                                            routed))
        rate = _matmul_seconds(work.flops, work.dtype, *work.tile, hw) if work.flops else 0.0
        bandwidth = hw.memory_bandwidth * hw.memory_efficiency
        loaded = work.bytes if work.loaded is None else work.loaded
        ends = {end: max(rate / (work.of_cublas if matmuls == "own" else 1.0),
                         (loaded if memory == "HBM" else work.bytes) / bandwidth) + hw.op_overhead
                for end, (memory, matmuls) in KERNEL_ENDS.items()}
        ranged = ends["slow"] > ends["fast"]
        return Cost(ends[self.kernels if ranged else "fast"], "matmul" if work.flops else "memory", work.flops,
                    work.bytes, kernel_ends=ends if ranged else None)

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

