"""Figures with the digits they need (olmax.figures), as every command and page writes them: a tiny model's
figures were printed as zeros (`MFU 0.0% (exact count)`, `TFLOP / device-step 0.0`, `0.00 G` a token)."""

import json
import re

import pytest

from olmax.cli import main
from olmax.figures import figure, percent, si
from olmax.scale.targets import aot_missing


def test_a_figure_keeps_its_significant_digits():
    assert [figure(v) for v in (0, 0.000184, 184.46, 1234.5, 7.298e9)] == ["0", "0.000184", "184.5", "1,234",
                                                                           "7,298,000,000"]
    assert [percent(v) for v in (0.000347, 0.445, 1.0)] == ["0.0347%", "44.5%", "100%"]
    assert [si(v, "FLOP") for v in (1.44e6, 184e9, 46.56e9, 12.0)] == ["1.44 MFLOP", "184 GFLOP", "46.56 GFLOP",
                                                                      "12 FLOP"]


def test_flops_and_plan_of_a_tiny_model_print_no_zeros(capsys):
    assert main(["flops", "tiny_moe"]) == 0
    out = capsys.readouterr().out
    assert "0.00" not in out and re.search(r"train FLOP / token +\d[\d.]* MFLOP", out), out
    assert main(["plan", "tiny", "--target", "tpu:v5p:2x2x2", "--mfu", "0.0005"]) == 0
    out = capsys.readouterr().out
    # the FLOP/s each device computes at that MFU, not to be read as its peak
    assert "at 0.05% MFU (given) of a peak of 459 TFLOP/s per chip (each device computing 229.5 GFLOP/s)" in out
    assert re.search(r"MFU +0.05% +0.05%", out), out


@pytest.mark.skipif(bool(aot_missing("tpu")), reason=str(aot_missing("tpu")))
def test_compile_of_a_tiny_model_prints_its_mfu_and_flops_and_its_page_too(capsys, tmp_path):
    assert main(["compile", "tiny", "--target", "tpu:v5p:2x2x2", "--report", str(tmp_path / "page")]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "page" / "report.json").read_text())
    exact = report["plan"]["exact_window"]
    assert f"MFU {percent(exact['mfu'])} (exact count)" in out and exact["mfu"] < 0.001, out
    assert f"FLOP / device-step     {si(exact['tflop_per_device_step'] * 1e12, 'FLOP')} (sliding" in out
    assert "MFU 0.0%" not in out and " 0.0 (" not in out
    page = re.sub(r"<[^>]+>", "", (tmp_path / "page" / "index.html").read_text())
    assert f"MFU {percent(report['step_time']['mfu'])} (exact FLOP count)" in page
    assert main(["compile", "tiny", "--target", "tpu:v5p:2x2x2"]) == 0  # the same program: from the cache
    out = capsys.readouterr().out
    # `compile 5 s (cached program)` was printed for a command that took 4.3 s in all
    assert f"compiled before, in {report['compile_seconds']:,.0f} s: this time the program came from the " in out
