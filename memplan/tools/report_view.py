"""How ``memplan report`` shows a plan: the report's data (`report_data`, also its JSON) and the
rich tables and the memory strip printed from it (`print_report`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

    from memplan.tools.viz import MemoryBreakdown

_STRIP_BLOCKS = " ▁▂▃▄▅▆▇█"


def fmt(n: float | None) -> str:
    """Bytes as the report prints them ("-" for none)."""
    from memplan.core.units import format_bytes

    return "-" if n is None else format_bytes(n)


def memory_strip(plan, width: int, breakdown: MemoryBreakdown | None = None
                 ) -> tuple[list[tuple[str, list[tuple[str, str]]]], int, int]:
    """Rows of (label, [(char, style)]) drawing eager and planned memory over predicted time.

    Both rows share the time axis of the longer schedule, so the planned row
    is longer by its overhead. A column is the peak within its slice, red
    where it is over the budget. The eight block heights span the lowest to
    the highest memory either schedule reaches (returned with the rows), so
    the differences between the two stay visible above the parameters. Under
    them, the phase axis; and when the step updates parameters, an ``updates``
    row marks the columns from the first update to the last (``breakdown``:
    the plan's `viz.memory_breakdown`, when the caller has it already).
    """
    from memplan.tools import viz

    eager, planned = viz.memory_timelines(plan)
    until = max(eager.total_time, planned.total_time)
    top = max(eager.peak, planned.peak, plan.budget)
    low = int(min(eager.memory.min(), planned.memory.min()))
    rows = []
    for label, tl in (("eager", eager), ("planned", planned)):
        cols = max(1, round(width * tl.total_time / until)) if until > 0 else width
        cells = []
        for v in viz.resample_max(tl, cols):
            idx = 1 + round(float(v - low) / (top - low) * 7) if top > low else 8
            style = "red" if v > plan.budget else ("green" if label == "planned" else "grey62")
            cells.append((_STRIP_BLOCKS[max(1, min(8, idx))], style))
        rows.append((label, cells))

    def column(t: float) -> int:
        return round(width * t / until) if until > 0 else 0

    rows.append(("", _phase_axis(column(planned.backward_start), width)))
    bd = breakdown if breakdown is not None else viz.memory_breakdown(plan)
    if bd.update_start is not None:
        rows.append(("updates", _update_row(column(bd.update_start), column(bd.update_end), width)))
    return rows, low, top


def _phase_axis(split: int, width: int) -> list[tuple[str, str]]:
    """``── forward ──┬── backward ──`` with the tick where backward begins."""
    def segment(text: str, n: int) -> str:
        if n < len(text) + 2:
            return "─" * n
        left = (n - len(text)) // 2
        return "─" * left + text + "─" * (n - len(text) - left)

    split = max(0, min(split, width - 1))
    return [(ch, "dim") for ch in segment(" forward ", split)] + [("┬", "yellow")] + [
        (ch, "dim") for ch in segment(" backward ", width - split - 1)
    ]


def _update_row(first: int, last: int, width: int) -> list[tuple[str, str]]:
    """``═`` under the columns where the optimizer updates run, blank elsewhere.

    A row of its own rather than a third phase on the axis: the updates may run
    during backward (each as its gradient is final), overlapping its columns."""
    first = max(0, min(first, width - 1))
    last = max(first + 1, min(last, width))  # at least one column: a short phase still shows
    return [(" ", "")] * first + [("═", "magenta")] * (last - first) + [(" ", "")] * (width - last)


def _breakdown_data(bd: MemoryBreakdown, plan) -> dict:
    """The JSON report's ``memory``: bytes per category at the planned peak and at most, and the host state."""
    from memplan.tools import viz

    at_peak, most = bd.at(bd.peak_index), bd.most()
    return {
        "categories": [name for name, _, _ in viz.BREAKDOWN_CATEGORIES],
        "labels": {name: label for name, label, _ in viz.BREAKDOWN_CATEGORIES},
        "at_peak": at_peak,
        "most": most,
        "peak": int(bd.total[bd.peak_index]),
        "host_optimizer_state_bytes": bd.host_optimizer_state_bytes,
        "host_state_params": bd.host_state_params,
        "updated_params": len(plan.analysis.lowered.updates),
        "updates_after_backward": bd.updates_after_backward,
    }


def report_data(target: Any, plan, progress: Any, depth: int, host_limit: int | None = None) -> dict:
    from memplan.tools import viz

    a = plan.analysis
    eager, planned = viz.memory_timelines(plan)
    until = max(eager.total_time, planned.total_time) or 1.0
    bd = viz.memory_breakdown(plan)
    return {
        "target": target.spec,
        "description": target.description,
        "summary": {
            "aten_ops": a.num_nodes,
            "param_bytes": a.param_bytes,
            "optimizer_state_bytes": a.optimizer_state_bytes,
            "eager_peak": a.eager_peak,
            "store_all_peak": plan.store_all_peak,
            "budget": plan.budget,
            "planned_peak": plan.predicted_peak,
            "predicted_time": plan.predicted_time,
            "store_all_time": plan.store_all_time,
            "predicted_overhead": plan.predicted_overhead,
            "method": plan.method,
            "status": plan.status,
            "gap": plan.gap,
            "solve_time": plan.solve_time,
            "device_profile": a.profile.name,
            "stage_seconds": dict(progress.times),
            "host_memory": plan.host_memory,  # what the plan keeps in host memory, by kind
            "host_memory_limit": host_limit,
            # bytes over the host link per updating step, each way, and the seconds the link needs for them
            "host_traffic": dict(zip(("to_host", "to_device"), plan.host_traffic)),
            "link_seconds": plan.link_time,
        },
        "memory": _breakdown_data(bd, plan),
        "modules": [r.as_dict() for r in viz.layer_breakdown(plan, depth)],
        "timeline": {
            "time_unit": "fraction of the longer schedule's predicted time",
            "backward_start": planned.backward_start / until,
            # The optimizer's update phase, first update to last (None without an optimizer).
            "update_start": None if bd.update_start is None else bd.update_start / until,
            "update_end": None if bd.update_end is None else bd.update_end / until,
            "eager": viz.resample_max(eager, max(1, round(100 * eager.total_time / until))).tolist(),
            "planned": viz.resample_max(planned, max(1, round(100 * planned.total_time / until))).tolist(),
        },
    }


def print_report(console, target: Any, plan, data: dict, top: int) -> None:
    from rich.table import Table
    from rich.text import Text

    s = data["summary"]
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("model", target.description)
    summary.add_row("joint graph", f"{s['aten_ops']} ATen ops (forward + backward), device profile {s['device_profile']}")
    summary.add_row("parameters", fmt(s["param_bytes"]))
    m = data["memory"]
    if m["updated_params"] or m["host_optimizer_state_bytes"]:
        where = f"{fmt(s['optimizer_state_bytes'])} on the device"
        if m["host_optimizer_state_bytes"]:
            n = m["host_state_params"]
            where += (f", {fmt(m['host_optimizer_state_bytes'])} in host memory ({n} parameter{'s' * (n != 1)}, "
                      "updated there)")
        when = ("the updates run once every gradient is final, each freeing its gradient" if m["updates_after_backward"]
                else "each update runs in backward as soon as its gradient is final, and frees it")
        summary.add_row("optimizer state", f"{where}; {when}")
    if s["host_memory"]:
        from memplan.updates.host_memory import describe_parts

        held = sum(s["host_memory"].values())
        limit = f" of {fmt(s['host_memory_limit'])} it may use" if s["host_memory_limit"] else ""
        summary.add_row("host memory", f"{fmt(held)}{limit}: {describe_parts(s['host_memory'])}")
    traffic = s["host_traffic"]
    if traffic["to_host"] or traffic["to_device"]:
        compute = s["store_all_time"]
        bound = ("link-bound: the step waits for the link" if s["link_seconds"] > compute
                 else "within the step's compute")
        summary.add_row("host link", f"{fmt(traffic['to_host'])} to the host, {fmt(traffic['to_device'])} back per "
                                     f"step: {s['link_seconds'] * 1e3:.1f} ms at the profile's bandwidth, against "
                                     f"{compute * 1e3:.1f} ms of compute (store-all): {bound}")
    summary.add_row("eager peak", f"{fmt(s['eager_peak'])} (eager autograd, replayed on fake tensors); "
                                  f"{fmt(s['store_all_peak'])} keeping every value of the joint graph")
    summary.add_row("budget", fmt(s["budget"]))
    within = s["planned_peak"] <= s["budget"]
    summary.add_row("planned peak", Text(f"{fmt(s['planned_peak'])} ({s['planned_peak'] / s['budget']:.0%} of budget)",
                                         style="green" if within else "red"))
    summary.add_row("overhead", f"{s['predicted_overhead']:.3f}x store-all step time (predicted, "
                                f"{s['predicted_time'] * 1e3:.1f} ms vs {s['store_all_time'] * 1e3:.1f} ms)")
    gap = "no lower bound" if s["gap"] is None else f"gap {s['gap']:.1%} to its lower bound"
    summary.add_row("method", f"{s['method']} ({s['status']}), {gap}")
    summary.add_row("solve time", f"{s['solve_time']:.2f} s")
    console.print(summary)
    console.print()

    console.print(_memory_table(data))
    console.print()

    rows = data["modules"]
    shown = rows
    if len(rows) > top:
        biggest = sorted(rows, key=lambda r: -(r["kept_bytes"] + r["recomputed_bytes"] + r["offloaded_bytes"]))[:top]
        keep = {id(r) for r in biggest}
        shown = [r for r in rows if id(r) in keep]
    table = Table(title="saved activations by module", title_justify="left")
    table.add_column("module")
    for col in ("kept", "recomputed", "offloaded", "recompute time", "storages"):
        table.add_column(col, justify="right")
    for r in shown:
        table.add_row(
            r["module"], fmt(r["kept_bytes"]),
            Text(fmt(r["recomputed_bytes"]), style="yellow" if r["recomputed_bytes"] else ""),
            fmt(r["offloaded_bytes"]), f"{r['recompute_time'] * 1e3:.2f} ms", str(r["values"]),
        )
    if len(shown) < len(rows):
        table.add_row(Text(f"... {len(rows) - len(shown)} smaller modules (--top, --depth)", style="dim"), "", "", "", "", "")
    table.add_section()
    table.add_row(
        "total", fmt(sum(r["kept_bytes"] for r in rows)), fmt(sum(r["recomputed_bytes"] for r in rows)),
        fmt(sum(r["offloaded_bytes"] for r in rows)), f"{sum(r['recompute_time'] for r in rows) * 1e3:.2f} ms",
        str(sum(r["values"] for r in rows)),
    )
    console.print(table)
    console.print()

    width = max(20, min(90, console.width - 12))
    rows, low, high = memory_strip(plan, width)
    console.print(Text("memory over the step", style="bold"), Text(
        f"(predicted time →; a column is the peak in its slice, ▁ {fmt(low)} to █ {fmt(high)}, red over budget)",
        style="dim"))
    for label, cells in rows:
        line = Text(f"{label:>8}  ")
        for ch, style in cells:
            line.append(ch, style=style)
        console.print(line, no_wrap=True, overflow="crop")


# Rows of the whole-step table that are shown even at zero bytes: every step has them.
_ALWAYS_SHOWN = ("parameters", "gradients", "activations")


def _memory_table(data: dict) -> Table:
    """The whole step at the planned peak, by what holds the device memory (`viz.memory_breakdown`):
    parameters, gradients, optimizer state on the device and in host memory, activations."""
    from rich.table import Table
    from rich.text import Text

    m = data["memory"]
    optimizer = bool(m["updated_params"] or m["host_optimizer_state_bytes"])
    table = Table(title="device memory at the planned peak, by what holds it", title_justify="left")
    table.add_column("held by")
    table.add_column("at the peak", justify="right")
    table.add_column("share", justify="right")
    table.add_column("most in the step", justify="right")
    peak = m["peak"] or 1
    for name in m["categories"]:
        at, most = m["at_peak"][name], m["most"][name]
        if not (at or most or name in _ALWAYS_SHOWN or (name == "optimizer_state" and optimizer)):
            continue
        label = m["labels"][name] + (" (device)" if name == "optimizer_state" else "")
        table.add_row(label, fmt(at), f"{at / peak:.0%}", fmt(most))
        if name == "optimizer_state" and m["host_optimizer_state_bytes"]:
            # Off the device, so not part of the peak: in parentheses, under the device share.
            host = Text(f"({fmt(m['host_optimizer_state_bytes'])})", style="dim")
            table.add_row(Text("optimizer state (host)", style="dim"), host, "", host)
    table.add_section()
    table.add_row("planned peak", fmt(m["peak"]), "100%", "")
    return table
