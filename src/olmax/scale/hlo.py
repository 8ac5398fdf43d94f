"""The text of a compiled (optimized, scheduled) HLO module as data: its computations, each a list of
instructions in the order the compiler scheduled them, with shapes, operands and the attributes the
step-time model and the layout page read (called computations, loop trip counts, replica groups,
convolution windows, custom-call targets, the op names JAX wrote into the metadata)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import numpy as np

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all",
               "collective-broadcast")
BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
         "u64": 8, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "f4e2m1fn": 0.5}
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](\{[^}]*\})?")
_INTEGER = re.compile(r"[su](?:8|16|32|64)\[\]\S*")  # an integer scalar's type, with or without a layout
_HEAD = re.compile(r"^\s*(ROOT )?%([\w.-]+) = ")
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.-]+) .*\{$")
_OP = re.compile(r"([a-z][\w-]*)\(")


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    on_chip: bool = False  # a TPU layout's memory space S(1): in VMEM, not in HBM

    @property
    def bytes(self) -> float:
        return math.prod(self.dims) * BYTES.get(self.dtype, 1 if self.dtype.startswith("f8") else 4)


def arrays(type_text: str) -> list[Array]:
    """The arrays of an HLO type (one, or a tuple's several)."""
    return [Array(dtype, tuple(int(d) for d in dims.split(",") if d), bool(layout and "S(1)" in layout))
            for dtype, dims, layout in _ARRAY.findall(type_text) if dtype in BYTES or dtype.startswith("f8")]


@dataclass
class Instruction:
    name: str
    type_text: str
    op: str
    operands: list[str]
    attributes: str  # everything after the operand list, as printed
    root: bool = False
    arguments: str = ""  # the operand list as printed (a constant's literal)

    @property
    def outputs(self) -> list[Array]:
        return arrays(self.type_text)

    def attribute(self, key: str) -> str | None:
        """A `key=value` attribute's value (a balanced {...} or [...] group, a quoted string, or a word)."""
        at = self.attributes.find(f"{key}=")
        while at > 0 and self.attributes[at - 1] not in " ,":
            at = self.attributes.find(f"{key}=", at + 1)
        if at < 0:
            return None
        return _value(self.attributes, at + len(key) + 1)

    def calls(self) -> list[str]:
        """The computations this instruction runs (a fusion's, a call's, an async op's, a conditional's)."""
        found = []
        for key in ("calls", "to_apply", "true_computation", "false_computation"):
            if value := self.attribute(key):
                found += [v.strip().lstrip("%") for v in value.strip("{}").split(",")]
        if value := self.attribute("branch_computations"):
            found += [v.strip().lstrip("%") for v in value.strip("{}").split(",")]
        return found

    @property
    def op_name(self) -> str:
        found = re.search(r'op_name="([^"]*)"', self.attributes)
        return found.group(1) if found else ""

    @property
    def backend_config(self) -> dict:
        value = self.attribute("backend_config")
        if not value or not value.startswith("{"):
            return {}
        try:
            return json.loads(value)
        except ValueError:
            return {}

    def results(self, operands: list[Array]) -> list[Array]:
        """The arrays an op produces: an async start's tuple repeats its operands (and may hold a scalar context)
        before its results."""
        out = [a for a in self.outputs if a.dims or a.dtype not in ("u32", "s32")]
        if self.op.endswith("-start") and len(out) > len(operands):
            return out[len(operands):]
        return out

    def trip_count(self) -> int | None:
        """A while loop's trip count where the compiler knows it (its backend_config)."""
        found = re.search(r'"known_trip_count":\{"n":"(\d+)"', self.attributes)
        return int(found.group(1)) if found else None


def _value(text: str, start: int) -> str:
    """The attribute value starting at `start`: up to the matching bracket, the closing quote, or a comma."""
    opening = text[start:start + 1]
    if opening in "{[(":
        closing, depth = {"{": "}", "[": "]", "(": ")"}[opening], 0
        for i in range(start, len(text)):
            if text[i] == opening:
                depth += 1
            elif text[i] == closing:
                depth -= 1
                if depth == 0:
                    return text[start:i + 1]
        return text[start:]
    if opening == '"':
        end = text.find('"', start + 1)
        return text[start:end + 1]
    end = text.find(",", start)
    return text[start:end if end >= 0 else len(text)].strip()


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesised group opening at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def parse_instruction(line: str) -> Instruction | None:
    head = _HEAD.match(line)
    if not head:
        return None
    at = head.end()
    if line.startswith("(", at):  # a tuple type
        end = _balanced(line, at)
    else:
        end = line.find(" ", at)
    type_text = line[at:end]
    found = _OP.match(line, end + 1)
    if not found:
        return None
    close = _balanced(line, found.end() - 1)
    arguments = line[found.end():close - 1]
    return Instruction(head.group(2), type_text, found.group(1), re.findall(r"%([\w.-]+)", arguments), line[close:],
                       bool(head.group(1)), arguments)


@dataclass
class Computation:
    name: str
    entry: bool
    instructions: list[Instruction] = field(default_factory=list)
    by_name: dict[str, Instruction] = field(default_factory=dict)

    @property
    def root(self) -> Instruction:
        return next((i for i in self.instructions if i.root), self.instructions[-1])


class Module:
    """A parsed HLO module: computations by name, the entry's name."""

    def __init__(self, text: str):
        self.computations: dict[str, Computation] = {}
        self.entry = ""
        current = None
        for line in text.splitlines():
            if line.endswith("{") and (found := _COMPUTATION.match(line)):
                current = Computation(found.group(2), bool(found.group(1)))
                self.computations[current.name] = current
                if current.entry:
                    self.entry = current.name
                continue
            if current is None or line.startswith("}"):
                continue
            instruction = parse_instruction(line)
            if instruction is not None:
                current.instructions.append(instruction)
                current.by_name[instruction.name] = instruction

    def computation(self, name: str) -> Computation | None:
        return self.computations.get(name)

    def trip_count(self, loop: Instruction, caller: Computation | None = None) -> int | None:
        """A while loop's trip count: the compiler's, or else a counter compared with one integer constant in the
        loop's condition (or in a fusion it calls), less the counter's first value where the caller starts it at
        a constant (a loop whose first iteration the compiler peeled starts at 1), over the body's step. The
        counter is the tuple element the condition reads (a scan's is the first; a windowed einsum's, an unsigned
        one further on). None when neither says."""
        if (known := loop.trip_count()) is not None:
            return known
        condition = self.computations.get((loop.attribute("condition") or "").lstrip("%"))
        bounds, counters, seen, todo = [], [], set(), [condition] if condition else []
        while todo:
            computation = todo.pop()
            seen.add(computation.name)
            for i in computation.instructions:
                if _INTEGER.fullmatch(i.type_text) and (value := _integer(i)) is not None:
                    bounds.append(value)
                if i.op == "get-tuple-element" and computation is condition and _INTEGER.fullmatch(i.type_text):
                    counters.append(int(i.attribute("index") or 0))
                todo += [c for name in i.calls() if (c := self.computations.get(name)) and c.name not in seen]
        if len(bounds) != 1:
            return None
        counter = counters[0] if len(counters) == 1 else 0
        start = 0
        init = caller.by_name.get(loop.operands[0]) if caller and loop.operands else None
        if init is not None and init.op == "tuple" and len(init.operands) > counter:
            start = _integer(caller.by_name.get(init.operands[counter])) or 0
        return max(-(-(bounds[0] - start) // self._step(loop, counter)), 0)

    def _step(self, loop: Instruction, counter: int) -> int:
        """What a loop's body adds to its counter each iteration: the constant in `counter + c` at the counter's
        place of the body's result (a bidirectional windowed einsum does two windows an iteration and steps by 2),
        else 1."""
        body = self.computations.get((loop.attribute("body") or "").lstrip("%"))
        root = body.root if body and body.instructions else None
        if root is None or root.op != "tuple" or len(root.operands) <= counter:
            return 1
        update = body.by_name.get(root.operands[counter])
        if update is None or update.op != "add":
            return 1
        steps = [value for name in update.operands if (value := _integer(body.by_name.get(name))) is not None]
        return max(steps[0], 1) if steps else 1


def _integer(instruction: Instruction | None) -> int | None:
    """An integer constant's value; None for any other instruction."""
    if instruction is not None and instruction.op == "constant" and re.fullmatch(r"-?\d+", instruction.arguments):
        return int(instruction.arguments)
    return None


# --- replica groups -------------------------------------------------------------------------------------------------

def replica_groups(instruction: Instruction, n_devices: int) -> list[list[int]]:
    """The device groups of a collective (partition ids), from any of the forms XLA prints: explicit lists,
    iota lists (`[2,4]<=[8]`, with a transpose), mesh axes (`mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`, sub-axes
    `'axis_0':(2)4`), and a collective-permute's source-target pairs (each pair a group)."""
    text = instruction.attributes
    if found := re.search(r"source_target_pairs=\{(.*?)\}\}", text):
        return [[int(v) for v in pair.split(",")] for pair in re.findall(r"\{?(\d+,\d+)", found.group(1))]
    if found := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text):
        groups, size, dims, perm = found.groups()
        ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.transpose([int(p) for p in perm.split(",")])
        return ids.reshape(int(groups), int(size)).tolist()
    if found := re.search(r"replica_groups=mesh\[([^\]]*)\](?:\s*<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}", text):
        return _mesh_groups(*found.groups())
    if found := re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", text):
        return [[int(v) for v in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", found.group(1))]
    return [list(range(n_devices))]


def _mesh_groups(axes_text: str, dims: str | None, perm: str | None, members_text: str) -> list[list[int]]:
    """Groups of a mesh-axes replica group list: the devices of a mesh (iota order, or the given reshape and
    transpose) that differ only along the listed axes (or sub-axes `'a':(pre)size`)."""
    axes = [(name, int(size)) for name, size in re.findall(r"'?([\w.-]+)'?=(\d+)", axes_text)]
    shape = [size for _, size in axes]
    ids = np.arange(math.prod(shape))
    if dims:
        ids = ids.reshape([int(d) for d in dims.split(",")])
        if perm:
            ids = ids.transpose([int(p) for p in perm.split(",")])
    # split every axis into (pre, size, post) sub-axes so that a sub-axis reference is a whole dimension
    split, names = [], []
    chosen = re.findall(r"'?([\w.-]+)'?(?::\((\d+)\)(\d+))?", members_text)
    for name, size in axes:
        subs = [(int(pre), int(sub)) for ref, pre, sub in chosen if ref == name and pre]
        if subs:
            pre, sub = subs[0]
            parts = [(pre, None), (sub, name), (size // (pre * sub), None)]
        else:
            parts = [(size, name if any(ref == name and not pre for ref, pre, _ in chosen) else None)]
        for part_size, member in parts:
            split.append(part_size)
            names.append(member)
    grid = ids.reshape(split)
    varying = [i for i, member in enumerate(names) if member is not None]
    fixed = [i for i in range(len(split)) if i not in varying]
    grid = grid.transpose(fixed + varying)
    group_size = math.prod(split[i] for i in varying)
    return grid.reshape(-1, group_size).tolist()
