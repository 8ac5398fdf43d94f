"""A training process restarts itself once with glibc's malloc on huge pages, with its arguments intact."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from olmax.runtime import HUGE_PAGES, huge_pages_env

PROBE = (
    "import os, sys\n"
    "print('started', flush=True)\n"
    "from olmax.runtime import restart_with_huge_pages\n"
    "restart_with_huge_pages()\n"
    "print(os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])\n"
)

needs_huge_pages = pytest.mark.skipif(
    "GLIBC_TUNABLES" not in huge_pages_env({}), reason="no glibc >= 2.35 or no transparent huge pages here")


def probe(**env) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "OLMAX_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", PROBE, "train", "a b", "x=1"], env={**base, **env},
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


@needs_huge_pages
def test_restarts_once_with_the_tunable_and_the_same_arguments():
    assert probe() == ["started", "started", f"{HUGE_PAGES} ['train', 'a b', 'x=1']"]


@needs_huge_pages
def test_other_tunables_are_kept_and_a_set_one_is_not_overridden():
    assert probe(GLIBC_TUNABLES="glibc.malloc.tcache_count=0")[-1].startswith(
        f"glibc.malloc.tcache_count=0:{HUGE_PAGES} ")
    assert probe(GLIBC_TUNABLES="glibc.malloc.hugetlb=0") == ["started", "glibc.malloc.hugetlb=0 ['train', 'a b', 'x=1']"]


def test_opt_out_leaves_the_process_alone():
    assert probe(OLMAX_HUGE_PAGES="0") == ["started", "None ['train', 'a b', 'x=1']"]
