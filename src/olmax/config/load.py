"""Loading a config: a preset (a name under `olmax/configs/`) or a YAML file, its `base:` chain, its layout for a
target, `key=value` overrides and YAML files of settings over it, validated into a RunConfig; every key checked
against the schema (a moved key named with its new place, an unknown one with the closest known), and a bad value
one line naming the field and the fix. And the config as a checkpoint's meta holds it: written (`dump`) and read
back from an older olmax (`upgrade`)."""

from __future__ import annotations

import difflib
import fnmatch
import json
import os
import types
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from olmax.config.run import RunConfig
from olmax.errors import ConfigError

PRESET_DIR = Path(__file__).parent.parent / "configs"
# Keys that moved out of `model` (architecture) into `impl` (how it runs), or were reshaped: an override or
# YAML key naming the old place is refused with the new one; `upgrade` moves them in an older checkpoint's config.
MOVED_KEYS = {
    "model.compute_dtype": "impl.compute_dtype",
    "model.remat_save": "impl.remat",
    "model.attention_block": "impl.attention.block",
    "model.scan_layers": "impl.scan_layers",
    "model.rope_theta": "model.rope.global.theta and model.rope.sliding.theta",
    "impl.moe_dispatch": "impl.moe.dispatch",
    "impl.moe_block": "impl.moe.block",
    "impl.moe_ep_capacity": "impl.moe.ep_capacity",
}


def _set_path(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
    node[leaf] = value


def _known_path(dotted: str) -> None:
    if dotted in MOVED_KEYS:
        raise ConfigError(f"config key {dotted!r} moved: set {MOVED_KEYS[dotted]} instead")
    section: type[BaseModel] = RunConfig
    for i, key in enumerate(dotted.split(".")):
        fields = {field.alias or name: field for name, field in section.model_fields.items()}
        if key not in fields:
            where = ".".join(dotted.split(".")[:i]) or "the top level"
            raise ConfigError(f"unknown config key {dotted!r}{_did_you_mean(dotted, list(_config_keys()))}: "
                              f"{where} has {sorted(fields)}")
        annotation = fields[key].annotation
        if isinstance(annotation, types.UnionType):  # an optional section (model.moe)
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            section = annotation
        else:
            return


def _config_keys(section: type[BaseModel] = RunConfig, prefix: str = ""):
    """Every dotted key of the schema, sections and settings."""
    for name, field in section.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        yield key
        annotation = field.annotation
        if isinstance(annotation, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _config_keys(annotation, f"{key}.")


def _did_you_mean(given: str, known: list[str]) -> str:
    """` (did you mean X?)` naming the known names closest to `given`: those ending in its last dotted part (a
    bare `steps` is `train.steps`), else those spelled nearly as it is; empty when none is close."""
    last = given.rsplit(".", 1)[-1]
    close = [k for k in known if k.rsplit(".", 1)[-1] == last and k != given][:3] or difflib.get_close_matches(
        given, [k for k in known if k.count(".") == given.count(".")], n=3, cutoff=0.75)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def presets() -> list[str]:
    """The names of the configs that ship with olmax."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist")
        return path
    path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(f"no preset {name_or_path!r}{_did_you_mean(str(name_or_path), presets())}; presets: "
                          f"{presets()}, or pass a .yaml path")
    return path


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merge keys may be overridden by design
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in lines:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice, on lines {lines[key]} and {line}; keep one",
                    key_node.start_mark)
            lines[key] = line
        return super().construct_mapping(node, deep)


def _parsed(text: str, where: str):
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{where} is not valid YAML ({at}{getattr(err, 'problem', None) or err})") from None


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """The file's settings over those of its `base:` chain; `chain` is the files that named this one."""
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"config files name each other as base in a cycle ({cycle}); break it")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass a YAML file or a preset name")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err})") from None
    raw = _parsed(text, f"config file {path}") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read_yaml(preset_path(base), (*chain, path.resolve()))
    for key, value in _flatten(raw):
        _set_path(merged, key, value)
    return merged


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# What a layout may set: how the step is laid out on the devices, not what it computes.
LAYOUT_KEYS = ("mesh.", "impl.", "train.micro_batch_per_device", "eval.batch_instances")


def _layouts(tree: dict, where: str) -> dict[str, dict]:
    """Pop the config's `layouts:` section: a target (`gpu:b300x8`; a pattern, `tpu:v5p:*`) -> the settings the
    run takes on those devices (mesh, remat, micro-batch: how the step is laid out, not what it computes)."""
    layouts = tree.pop("layouts", None) or {}
    if not isinstance(layouts, dict) or not all(isinstance(v, dict) for v in layouts.values()):
        raise ConfigError(f"{where}: layouts must map a target (gpu:b300x8, tpu:v5p:*) to sections of settings")
    for pattern, settings in layouts.items():
        for key, _ in _flatten(settings):
            try:
                _known_path(key)
            except ConfigError as err:
                raise ConfigError(f"{where}: layouts.{pattern}: {err}") from None
            if not key.startswith(LAYOUT_KEYS):
                raise ConfigError(f"{where}: layouts.{pattern}: {key} is not a layout setting (those are "
                                  f"{', '.join(k + '*' if k.endswith('.') else k for k in LAYOUT_KEYS)}): a run's "
                                  "recipe is the same on every target; set it outside layouts")
    return layouts


def _layout_for(layouts: dict[str, dict], target: str | None, where: str) -> tuple[str, dict] | None:
    found = [pattern for pattern in layouts if target and fnmatch.fnmatchcase(target, pattern)]
    if len(found) > 1:
        raise ConfigError(f"{where}: layouts {found} all match target {target}; narrow them to one")
    return (found[0], layouts[found[0]]) if found else None


def target_layout(name_or_path: str, target: str | None) -> tuple[str, list[str]] | None:
    """The config's layout for `target` (a target name, as `olmax compile --target` takes): its pattern and its
    settings as `a.b=value` lines, or None when it has none (command-line overrides still win over them)."""
    tree = _read_yaml(preset_path(name_or_path))
    found = _layout_for(_layouts(tree, str(name_or_path)), target, str(name_or_path))
    return found and (found[0], [f"{key}={value if isinstance(value, str) else json.dumps(value)}"
                                 for key, value in _flatten(found[1])])


def _overlay(path: str, config: str) -> dict:
    """A file of settings merged over a config (`olmax train CONFIG best.yaml`, as `olmax tune --out` writes it); its
    `base:`, if it names one, must be that config."""
    try:
        raw = _parsed(Path(path).read_text(), f"config file {path}") or {}
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is not None and preset_path(base).resolve() != preset_path(config).resolve():
        raise ConfigError(f"{path} has base {base}, not {config}: merge it over {base}, or drop its base: line")
    if "layouts" in raw and raw["layouts"] is None:  # `olmax tune --out`'s: the config's own, applied before it
        del raw["layouts"]
    return raw


def load_config(name_or_path: str, overrides: list[str] = (), target: str | None = None) -> RunConfig:
    """A preset name or YAML path (which may name a `base:` preset), its layout for `target` if it has one,
    then the overrides in order: `a.b=value`, or a YAML file of settings merged over it."""
    tree = _read_yaml(preset_path(name_or_path))
    layout = _layout_for(_layouts(tree, str(name_or_path)), target, str(name_or_path))
    for key, _ in _flatten(tree):
        _known_path(key)
    for key, value in _flatten(layout[1] if layout else {}):
        _set_path(tree, key, value)
    for item in overrides:
        if "=" not in item and item.endswith((".yaml", ".yml")):
            for key, value in _flatten(_overlay(item, name_or_path)):
                _known_path(key)
                _set_path(tree, key, value)
            continue
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (or be a .yaml file of settings)")
        key, text = item.split("=", 1)
        _known_path(key)
        _set_path(tree, key, _parsed(text, f"override {item!r}: the value"))
    return validate(tree, source=str(name_or_path))


def writable_dir(path: Path, field: str) -> Path:
    """`path`, refused when it, or a directory it would be made in, is an existing file or not writable."""
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                raise ConfigError(f"{field} {path}: {existing} is a file, not a directory; set another {field}")
            if not os.access(existing, os.W_OK):
                raise ConfigError(f"{field} {path}: {existing} is not writable; set another {field}")
            break
    return path


def _nul_bytes(value, where: str):
    """The dotted places of the strings in `value` that hold a NUL byte (which no path, name or command can)."""
    if isinstance(value, str) and "\0" in value:
        yield where
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _nul_bytes(item, f"{where}.{key}".lstrip("."))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _nul_bytes(item, f"{where}[{i}]")


def validate(tree: dict, source: str = "config") -> RunConfig:
    if found := next(_nul_bytes(tree, ""), None):
        raise ConfigError(f"{source}: {found} holds a NUL byte, which no name or path can hold; remove it")
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        lines = [f"{source}: invalid config"]
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "(top level)"
            got = e.get("input")
            shown = f" (got {got!r})" if e["loc"] and not isinstance(got, dict) else ""
            lines.append(f"  {where}: {e['msg'].removeprefix('Value error, ')}{shown}")
        if len(lines) == 2:  # one error: one line
            raise ConfigError(f"{lines[0]}: {lines[1].strip().removeprefix('(top level): ')}") from None
        raise ConfigError("\n".join(lines)) from None


def upgrade(tree: dict) -> dict:
    """A config as written by an older olmax (a checkpoint's meta), with moved keys in their new places."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    model, impl = tree.setdefault("model", {}), tree.setdefault("impl", {})
    if "rope_theta" in model:
        theta = model.pop("rope_theta")
        model["rope"] = {kind: {"theta": theta} for kind in ("sliding", "global")}
    for old, new in (("compute_dtype", "compute_dtype"), ("remat_save", "remat"), ("scan_layers", "scan_layers")):
        if old in model:
            impl[new] = model.pop(old)
    if "attention_block" in model:
        impl["attention"] = {"block": model.pop("attention_block")}
    for old in ("dispatch", "block", "ep_capacity"):
        if f"moe_{old}" in impl:
            impl.setdefault("moe", {})[old] = impl.pop(f"moe_{old}")
    return tree


def dump(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
