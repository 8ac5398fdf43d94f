"""Checks on every value `olmax launch` writes into a job script, a command line or a manifest.

A batch script's `#SBATCH` lines are comments to bash but options to sbatch, which reads them with its own
tokenizer: a newline in a value ends the comment and makes the rest a command, a quote or a space changes
what sbatch reads. Values there are refused unless they are plain words; the command lines themselves are
quoted (shlex). Kubernetes names are DNS-1035 labels, derived from the run's name.
"""

from __future__ import annotations

import hashlib
import re

from olmax.errors import ConfigError

# A plain word: no whitespace or control characters, no quotes, backslashes or shell syntax.
PLAIN = re.compile(r"[^\s'\"\\`$;&|<>()]+")
# Slurm names (partitions, accounts, QOS): letters, digits, '.', '_', '-'; partitions may be a list.
SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*")
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds (man sbatch), or no limit.
SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE")
# An option of sbatch's own, whose value may hold the & and | of a feature constraint (a #SBATCH line is a
# comment to bash).
SBATCH_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=[^\s'\"\\`$;<>()]+)?")
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_LENGTH = 63


def refuse(field: str, value, rule: str):
    raise ConfigError(f"{field}={value!r} cannot go into the job: {rule}")


def plain(field: str, value: str) -> str:
    """`value`, when it is one plain word (a job name, a path)."""
    if not PLAIN.fullmatch(value):
        refuse(field, value, "use letters, digits and punctuation other than quotes, spaces and $`;&|<>()\\")
    return value


def slurm_name(field: str, value: str) -> str:
    if not SLURM_NAME.fullmatch(value):
        refuse(field, value, "a Slurm name is letters, digits, '.', '_' and '-' (partitions: a list with ',')")
    return value


def slurm_time(value: str) -> str:
    if not SLURM_TIME.fullmatch(value):
        refuse("launch.slurm.time", value, 'use sbatch\'s formats: "MM", "HH:MM:SS", "D-HH", "D-HH:MM:SS"')
    return value


def sbatch_option(value: str) -> str:
    if not SBATCH_OPTION.fullmatch(value):
        refuse("launch.slurm.sbatch_lines", value, "write each as --option or --option=value, without spaces, "
               "quotes or shell syntax")
    return value


def k8s_name(text: str, room: int = 0) -> str:
    """A DNS-1035 label (lowercase letters, digits, '-'; starts with a letter; at most 63 characters less `room`,
    for what Kubernetes appends) naming `text`: the name itself where that is one, else what is left of it and a
    hash of the whole, so that two names never give one label (`a_b`, `a.b` and `a-b` are three)."""
    limit = DNS_LABEL_LENGTH - room
    if DNS_LABEL.fullmatch(text) and len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    kept = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    kept = (kept if kept[:1].isalpha() else f"run-{kept}".rstrip("-"))[:limit - len(digest) - 1].rstrip("-")
    return f"{kept}-{digest}"
