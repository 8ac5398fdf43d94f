"""The command line's conventions, in one place for every command's parser.

- CONFIG, a preset name or a YAML path, is the first positional argument of a command that takes one,
  followed by `section.key=value` overrides (which may also come after the command's options).
- What a command reads is positional (CONFIG, a checkpoint, an HF directory, text files); what it writes is
  `--out`.
- Rows per batch are `--batch-size`.
- A command's handler is `cmd_NAME(args)`.

Spellings from before these conventions are kept for one release: they work as before and print one line
saying what to write instead (`old_spelling`, read back with `given`).
"""

from __future__ import annotations

import argparse
import sys

from olmax.errors import BadInput


def config_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG and its overrides."""
    parser.add_argument("config", help="preset name (olmo3_7b, tiny, ...) or a YAML path")
    parser.add_argument("overrides", nargs="*", default=[], help="section.key=value")  # optional: not "required"


class _OldSpelling(argparse.Action):
    def __init__(self, option_strings, dest, instead: str, **kwargs):
        self.instead = instead
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None:  # an optional positional that was not given comes here with None
            spelling = option_string or f"the {self.dest.removeprefix('old_')} argument"
            print(f"olmax: {spelling} is the old spelling, kept for one release: {self.instead}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def old_spelling(parser: argparse.ArgumentParser, name: str, dest: str, instead: str, **kwargs) -> None:
    """Accept `name` (an option, or a positional when it has no dashes) for what is now `dest`."""
    names, keywords = ([name], {"dest": f"old_{dest}"}) if name.startswith("-") else ([f"old_{dest}"], {"nargs": "?"})
    parser.add_argument(*names, **keywords, action=_OldSpelling, instead=instead, default=None,
                        help=f"old spelling, kept for one release: {instead}", **kwargs)


def given(args: argparse.Namespace, dest: str, what: str, required: bool = False):
    """The value of `dest`, given in its spelling or the old one (not both); None when neither was given,
    exit 2 asking for `what` when it is `required`."""
    new, old = getattr(args, dest, None), getattr(args, f"old_{dest}", None)
    if new is not None and old is not None:
        raise BadInput(f"{what} is given twice ({new} and {old}); give it once")
    value = old if new is None else new
    if value is None and required:
        raise BadInput(f"give {what}")
    return value
