"""What `olmax tune` says of a search (olmax.scale.tune): its table, ranked; the line of what it covered and how the
figures were found; its best; and the best layout as a config file that compiles and trains to the program ranked."""

from __future__ import annotations

from olmax.config import load_config
from olmax.figures import size
from olmax.scale.targets import Target
from olmax.scale.tune import MISSED, SHALLOW, STATUSES, Result, Search


def table(search: Search, target: Target, limit: int | None = None) -> str:
    lines = [f"{'#':>3}  {'step s':>9} {'MFU':>7} {'tokens/s/chip':>14} {'peak':>11}  {'status':15} layout"]
    shown = [r for r in search.ranked() if r.status != "pruned"]
    for i, r in enumerate(shown[:limit] if limit else shown, 1):
        step = f"{r.step_seconds:9.4g}" if r.step_seconds else f"{'-':>9}"
        mfu = f"{100 * r.mfu:6.3g}%" if r.mfu else f"{'-':>7}"
        tps = f"{r.tokens_per_chip:14,.0f}" if r.tokens_per_chip else f"{'-':>14}"
        peak = f"{size(r.peak):>11}" if r.peak else f"{'-':>11}"
        lines.append(f"{i:3}  {step} {mfu} {tps} {peak}  {r.status:15} {r.candidate.describe()}"
                     + (f"  ({r.reason})" if r.status in ("failed", "lost") else "") + _how(r))
    return "\n".join(lines)


def _how(r: Result) -> str:
    """How a row's figures were found, where not by one compile of the whole."""
    if r.depths:
        return f"  (extrapolated from {r.depths[0]} and {r.depths[1]} layers)"
    if r.error:
        return "  (compiled whole; extrapolated " + ", ".join(
            f"{name} {100 * e:+.1f}%" for name, e in r.error.items() if e is not None) + ")"
    return f"  (compiled whole: {r.whole})" if r.whole else ""


def coverage(search: Search) -> str:
    counts = {s: sum(r.status == s for r in search.results) for s in STATUSES}
    tried = len(search.results) - counts["pruned"]
    left = search.size - len(search.results)
    lost = f", {counts['lost']} lost with their workers" if counts["lost"] else ""
    ahead = (f"{search.ahead} compiled ahead of the search and not needed (kept in the compile cache); "
             if search.ahead else "")
    return (f"searched {len(search.results)} of {search.size} layouts: {tried} compiled ({search.compiled} programs "
            f"new, {sum(r.cached for r in search.results)} layouts from the cache), {counts['pruned']} pruned as out of memory "
            f"by a layout that keeps less; {counts['fits']} fit, {counts['over headroom']} over the headroom, "
            f"{counts['out of memory']} out of memory, {counts['failed']} failed{lost}; {left} not reached "
            "within the budget; "
            f"{_depths(search)}{ahead}{search.seconds:.0f} s")


def _depths(search: Search) -> str:
    """How many layouts a depth-reduced search extrapolated, and why it compiled the others whole."""
    if not search.reduced:
        return ""
    why = {reason: sum(r.whole == reason for r in search.results) for reason in (SHALLOW, MISSED)}
    whole = "; ".join(f"{n} compiled whole as {reason}" for reason, n in why.items() if n)
    return f"{sum(bool(r.depths) for r in search.results)} by depth-reduced compiles{'; ' + whole if whole else ''}; "


def overlay(config: str, overrides: list[str], search: Search, target: Target) -> str:
    """The best layout as a config file: the whole config of the program compiled and ranked (CONFIG with its layout
    for the target, the settings given on the command line, the layout searched), so that it compiles and trains to
    that program, as `olmax train FILE` or merged over CONFIG (`olmax train CONFIG FILE`; its `base:` says which
    config it is for). `layouts: null`: CONFIG's layouts for targets, applied already, do not apply over it again."""
    import yaml

    best = search.best
    cfg = load_config(config, [*overrides, *best.candidate.overrides()], target.name)
    head = (f"# olmax tune {' '.join([config, *overrides])} --target {target.name}: the fastest layout that fits "
            f"({best.candidate.describe()})\n"
            f"# predicted step {best.step_seconds:.4g} s, MFU {100 * best.mfu:.3g}%, peak {size(best.peak)} a device\n"
            "# the whole config of the program ranked: what was given and what was searched, resolved\n")
    flag_note = ("" if best.candidate.flags or not target.xla_flags else
                 f"# compiled with the compiler's default flags: unset the {target.kind} profile on the chips\n")
    return head + flag_note + yaml.safe_dump({"base": config, **cfg.model_dump(mode="json"), "layouts": None},
                                             sort_keys=False)


def main_line(search: Search) -> str:
    best = search.best
    if best is None:
        return "no layout fits within the headroom among those searched; raise --budget or --headroom"
    return f"best: {best.candidate.describe()} at {best.step_seconds:.4g} s a step"
