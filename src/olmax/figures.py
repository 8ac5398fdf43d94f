"""How every command and page writes a figure: with the digits it needs, so that a tiny model's figures are not
printed as zeros (`MFU 0.0%`, `0.00 GFLOP`) nor a large one's as a string of digits."""

from __future__ import annotations

SI_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))


def figure(value: float) -> str:
    """Whole numbers with thousands separators from 1,000, four significant digits below (0.0347, 184.5, 0)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def percent(fraction: float) -> str:
    """A fraction as a percentage, three significant digits: 0.445 -> 44.5%, 0.000347 -> 0.0347%."""
    return f"{100 * fraction:.3g}%"


def prefix(value: float, largest: float = 1e15) -> tuple[float, str]:
    """(scale, SI prefix): the largest prefix up to `largest` that writes `value` with a digit before the point."""
    return next(((scale, p) for scale, p in SI_PREFIXES if scale <= largest and abs(value) >= scale), SI_PREFIXES[-1])


def si(value: float, unit: str, largest: float = 1e15) -> str:
    """`value` of `unit` with its SI prefix: 1.44e6 FLOP -> 1.44 MFLOP, 184e9 FLOP -> 184 GFLOP."""
    scale, p = prefix(value, largest)
    return f"{figure(value / scale)} {p}{unit}"


def size(value: int) -> str:
    """Bytes in the unit that shows them best: 1.50 GiB, 12.00 MiB, 512 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value:,} B"
