"""Imports run one way: cli -> scale -> {train, eval, interop, launch} -> {model, data, checkpoint} -> parallel
-> config (scale compiles the train step). A package that needs a sibling's code means that code belongs lower."""

import ast
from pathlib import Path

import olmax

LAYERS = [
    {"config", "runtime", "storage"},
    {"parallel"},
    {"model", "data", "checkpoint"},
    {"train", "eval", "interop", "launch"},
    {"scale"},  # compiles the train step ahead of time
    {"cli", "demo"},  # and every package's cli.py: the commands
]
ROOT = Path(olmax.__file__).parent


def _layer(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if module in names)


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("olmax."):
            yield node.module.split(".")[1], node.lineno
        elif isinstance(node, ast.Import):
            yield from ((a.name.split(".")[1], node.lineno) for a in node.names if a.name.startswith("olmax."))


def test_imports_only_go_down():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[0] == "__init__":
            continue
        layer = len(LAYERS) - 1 if parts[-1] == "cli" else _layer(parts[0])
        for target, line in _imports(path):
            if target != parts[0] and _layer(target) >= layer < len(LAYERS) - 1:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports olmax.{target}")
    assert not wrong, "\n".join(wrong)
