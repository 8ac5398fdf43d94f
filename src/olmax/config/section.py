"""What every config section shares: the base class (unknown keys and non-finite floats refused), and the checks
of a section's values that several sections make."""

from __future__ import annotations

import importlib
import string
from typing import Literal

from pydantic import BaseModel, ConfigDict

DType = Literal["float32", "bfloat16"]
NAME_MAX, PATH_MAX = 255, 4096  # bytes in a path component and in a whole path, as Linux file systems take them


def declared_above(module: str, check: str):
    """A config check declared where what it checks is defined, in a package above this one: a model family's
    rules in its module (olmax.model.families), a pipeline schedule's in olmax.parallel.schedules. Looked up by
    name when a config is validated, so every config is checked whatever was imported first, and those packages
    import this one, not the other way round."""
    return getattr(importlib.import_module(module), check)


def check_placeholders(value: str) -> str:
    """ValueError unless `value`'s only placeholder is a bare {name} (str.format would reach attributes of the name,
    `{name.__doc__}`, or pad it, `{name:>300}`)."""
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(value)
                  if name is not None]
    except ValueError:
        fields = [(None, None, None)]
    if any(field != ("name", "", None) for field in fields):
        raise ValueError("the one placeholder is {name}, the run's name, as it is (write a brace as {{ or }})")
    return value


def check_path_length(path: str, field: str) -> None:
    """ValueError when `path` (a local path or a URL) is longer than a file system or a bucket takes."""
    parts = path.split("://", 1)[-1].split("/")
    if too_long := [part for part in parts if len(part.encode()) > NAME_MAX]:
        raise ValueError(f"{field} {path[:80]}...: {too_long[0][:40]}... is {len(too_long[0].encode())} bytes, over "
                         f"the {NAME_MAX} a name in a path can have; shorten it (or the run's name in it)")
    if len(path.encode()) > PATH_MAX:
        raise ValueError(f"{field} {path[:80]}... is {len(path.encode())} bytes, over the {PATH_MAX} of a path; "
                         "shorten it")


class Section(BaseModel):
    # Every float must be finite (`optim.lr=inf` would make every parameter NaN at the first step).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
