"""What olmax's HTML pages share (the layout pages of `olmax compile` / `plan` / `tune`, a run's page): one
self-contained file, inline SVG and CSS, no script, nothing fetched, every value escaped. A figure is an element
with `data-fact` (its path in the page's report.json, dot-separated) and `data-value` (the value there), so a test
reads the page back against the JSON."""

from __future__ import annotations

import html
import json

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; max-width: 1220px; color: #222; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ccc; }
h3 { font-size: 14px; margin: 14px 0 4px; }
table { border-collapse: collapse; margin: 6px 0; } td, th { padding: 2px 10px 2px 0; text-align: left;
  vertical-align: top; } th { border-bottom: 1px solid #999; } td.n, th.n { text-align: right; }
code, .mono { font: 12px ui-monospace, monospace; } .note { color: #555; max-width: 1000px; }
.swatch { display: inline-block; width: 11px; height: 11px; margin-right: 6px; border: 1px solid #888; }
.verdict-yes { color: #1a7f37; font-weight: bold; } .verdict-no { color: #c62828; font-weight: bold; }
svg { display: block; margin: 6px 0; } svg text { font: 11px system-ui, sans-serif; }
.scroll { overflow-x: auto; max-width: 1220px; }
"""


def fact(path: str, value, text: str | None = None) -> str:
    """A figure on the page, tied to its place in report.json."""
    shown = text if text is not None else (f"{value:,}" if isinstance(value, int) else str(value))
    return f'<span data-fact="{html.escape(path)}" data-value="{html.escape(json.dumps(value))}">{html.escape(shown)}</span>'


def table(header: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    th = "".join(f'<th class="{"n" if i in numeric else ""}">{h}</th>' for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f'<td class="{"n" if i in numeric else ""}">{c}</td>' for i, c in enumerate(row))
                   + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def document(title: str, body: str) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>{body}</body></html>\n")
