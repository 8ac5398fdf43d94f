"""Imports run one way: cli -> scale -> {train, eval, interop, launch} -> {model, data} -> parallel -> checkpoint
-> config -> run_dir -> storage -> errors (scale compiles the train step). A package that needs a sibling's code means that code belongs lower."""

import ast
from pathlib import Path

import olmax

LAYERS = [
    {"errors", "progress", "pages", "figures"},  # the bad-input error classes; the lines that break a silence; HTML;
    # how a figure is written: free of imports
    {"storage"},  # URLs and local paths alike: every reader and writer of files goes through it
    {"run_dir"},  # the files of a run directory: everything else asks it for their paths
    {"config", "runtime", "run_lock"},
    {"checkpoint", "outputs"},  # the Checkpointer (train, eval and interop use it); new output directories
    {"parallel"},
    {"model", "data"},
    {"train", "eval", "interop", "launch"},
    {"scale"},  # compiles the train step ahead of time
    {"cli", "demo", "arguments"},  # and every package's cli.py: the commands, and their conventions
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


def _module_imports() -> dict[str, set[str]]:
    """{module: the olmax modules (and names in them) it imports, at its top or in a function}."""
    found = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(("olmax", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        found[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("olmax"):
                found[module] |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found[module] |= {a.name for a in node.names if a.name.startswith("olmax")}
    return found


def test_no_two_modules_import_each_other():
    """Within a package too: what two modules both need belongs in a third that both import."""
    imports = _module_imports()
    pairs = sorted({tuple(sorted((a, b))) for a, targets in imports.items() for b in targets
                    if b in imports and b != a and a in imports[b]})
    assert not pairs, pairs


def _code(path: Path) -> str:
    """The source without docstrings and comments: names and strings the code uses."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None:
            node.body = node.body[1:]
    return ast.unparse(tree)


def test_the_train_step_knows_no_mlp_kind():
    """What an MLP sublayer kind adds to training comes from its hooks (olmax.model.mlp), not from train/step.py."""
    code = _code(ROOT / "train" / "step.py").lower()
    assert not [name for name in ("moe", "router", "routing", "score_bias", "per_expert", "experts") if name in code]


def test_hf_io_has_no_family_branches():
    """interop/hf.py reads and writes safetensors for any family: the families module says what each one is."""
    code = _code(ROOT / "interop" / "hf.py")
    assert not [name for name in ("olmo3", "olmoe", "Olmo3ForCausalLM", "OlmoeForCausalLM") if name in code]
