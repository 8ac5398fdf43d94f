"""The figures README.md and docs/ quote from olmax's commands are what those commands print now: each is produced
here by its command and found in the page's text, so a change that moves one fails until the page says the new
figure. (The commands that need minutes, compiles and the demo, are checked by the tests that already run them:
tiny_moe's kernel counts in test_scale_compile.py. BENCHMARKS.md's dated measurements are its own.)"""

import json
import re

import pytest
from testlib import ROOT

from olmax.cli import main


def _gflop(r: dict) -> str:
    return f"{r['train_flops_per_token'] / 1e9:.2f} GFLOP"


# (page, the command whose --json output gives the figures, the text the page says, made from that output)
FIGURES = [
    ("README.md", ["flops", "olmo3_7b"], lambda r: f"# {r['params']:,} parameters, {_gflop(r)} a token"),
    ("docs/model.md", ["flops", "olmo3_7b"],
     lambda r: f"`olmax flops olmo3_7b` prints {r['params']:,} parameters ({r['non_embedding_params']:,} "
               f"non-embedding) and {_gflop(r)} per token"),
    ("docs/model.md", ["flops", "olmoe_1b_7b"],
     lambda r: f"`olmax flops olmoe_1b_7b`: {r['params']:,} parameters, {r['active_params']:,} active per token"),
    ("docs/model.md", ["flops", "olmo3_moe_47b"],
     lambda r: f"`olmo3_moe_47b`: {r['params']:,} parameters, {r['active_params']:,} active"),
    ("docs/model.md", ["flops", "olmo3_moe_47b", "model.moe.num_experts=8"], lambda r: f"({r['params']:,} with 8 experts)"),
    ("docs/parallelism.md", ["flops", "olmo_moe_1t"],
     lambda r: f"{r['params']:,} parameters, {r['active_params']:,} active): 8 pipeline stages"),
    ("docs/parallelism.md", ["flops", "olmo_moe_2t4"],
     lambda r: f"{r['params']:,} parameters, {r['active_params']:,} active; the 1.2T with 384 experts"),
    ("docs/parallelism.md", ["plan", "olmo_moe_2t4", "--target", "gpu:b300x1024", "--mfu", "0.3813"],
     lambda r: f"gives {r['exact_window']['chip_hours_per_trillion_tokens']:,.0f} GPU-hours per trillion tokens"),
    ("docs/scale.md", ["plan", "olmo3_7b", "--target", "tpu:tpu7x:4x4x4", "--mfu", "0.445"],
     lambda r: f"gives the published {r['all_global']['chip_seconds_per_step']:.0f} chip-seconds a step "
               f"({r['all_global']['step_seconds']:.2f} s on 64 chips, {r['all_global']['step_seconds'] / 4:.2f} s on "
               f"256) and about {r['all_global']['chip_hours'] / 1e3:.0f}k chip-hours over "
               f"{r['steps'] / 1e6:.2f}M steps (every layer counted global), or "
               f"{r['exact_window']['chip_seconds_per_step']:.0f} and {r['exact_window']['chip_hours'] / 1e3:.1f}k "
               "with the windows counted exactly"),
]


def page_text(page: str) -> str:
    """The page with its lines joined by spaces, as a reader reads a sentence across them."""
    return re.sub(r"\s+", " ", (ROOT / page).read_text())


@pytest.mark.parametrize("page, command, said", FIGURES, ids=[f"{p}: {' '.join(c)}" for p, c, _ in FIGURES])
def test_a_figure_the_docs_quote_is_what_its_command_prints(page, command, said, capsys):
    assert main([*command, "--json"]) == 0
    expected = said(json.loads(capsys.readouterr().out))
    assert expected in page_text(page), f"{page} should say: {expected}"
