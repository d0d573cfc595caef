"""The bill as a terminal table, as JSON, and as a stacked bar chart (matplotlib, an optional extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainlint.memory import TERMS
from trainlint.memory.project import LABELS, Measured, Projection

ROWS = (*TERMS, "comm")
ROW_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "master": "fp32 master",
    "optimizer": "optimizer",
    "activations": "activations",
    "temporaries": "temporaries",
    "comm": "comm buffers",
}
FOOTNOTE = (
    "weights include buffers; activations: their largest live total; temporaries: those alive at the "
    "peak; comm buffers: DDP gradient buckets, or the largest gathered unit (ZeRO-2/3, FSDP)."
)


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def human(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in UNITS[:-1]:
        if n >= size:
            value = n / size  # 3 significant digits, but 1000-1023 stay whole numbers, not 1e+03
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{n} B"


def single_peak(m: Measured) -> int:
    return max((sum(p.by_kind.values()) for p in m.peaks), default=0)


def to_dict(m: Measured, projections: list[Projection], setup: dict[str, Any]) -> dict[str, Any]:
    """Everything the text and the picture show, in bytes."""
    options = {}
    for p in projections:
        entry: dict[str, Any] = {
            "label": LABELS[p.option],
            "shard_group": p.group,
            "per_rank": {
                k: (None if k == "activations" and not m.activations_measured else v)
                for k, v in p.terms.items()
            },
            "host": p.host,
            "model_state": p.model_state,
            "peak": p.peak if m.activations_measured else None,
            "peak_phase": p.peak_phase,
        }
        if not m.activations_measured:
            entry["peak_lower_bound"] = p.peak
        options[p.option] = entry
    return {
        **setup,
        "parameters": m.parameters,
        "trainable": m.trainable,
        "complete": m.activations_measured,
        "single_process": {
            "weights": m.weights,
            "gradients": m.gradients,
            "master": m.master,
            "optimizer": m.optimizer,
            "model_state": m.weights + m.gradients + m.master + m.optimizer,
            "peak": single_peak(m) if m.activations_measured else None,
            "peak_at": m.peak_where,
        },
        "activation_sites": [
            {"module": mod, "line": line, "bytes": n} for mod, line, n in m.activation_sites
        ],
        "options": options,
        "warnings": m.warnings,
    }


def render_text(data: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    opts = data["options"]
    title = (
        f"{data['model']}: {data['parameters']:,} parameters, {data['precision']}, {data['optimizer']}, "
        f"batch {data['batch_size']}, world size {data['world_size']} (bytes per rank)"
    )
    table = Table(title=title, caption=FOOTNOTE)
    table.add_column("per rank", no_wrap=True)
    for o in opts.values():
        table.add_column(o["label"], justify="right", no_wrap=True)
    for row in ROWS:
        table.add_row(ROW_LABELS[row], *(human(o["per_rank"][row]) for o in opts.values()))
    if any(o["host"] for o in opts.values()):
        table.add_row(
            "on the host", *(human(sum(o["host"].values())) if o["host"] else "" for o in opts.values())
        )
    table.add_section()
    table.add_row("model state", *(human(o["model_state"]) for o in opts.values()))
    peaks = (
        human(o["peak"]) if o["peak"] is not None else f">= {human(o['peak_lower_bound'])}"
        for o in opts.values()
    )
    table.add_row("[bold]peak[/bold]", *peaks)
    table.add_row(
        "peak during",
        *(o["peak_phase"].replace("step", "s").replace("optimizer", "optim") for o in opts.values()),
    )
    console.print(table)
    single = data["single_process"]
    console.print(f"One process: peak {human(single['peak'])} during {single['peak_at']}.")
    for site in data["activation_sites"]:
        where = (
            " ".join(x for x in (site["module"], site["line"]) if x and x != "?")
            or "outside the model (input, loss)"
        )
        console.print(f"  activations at their peak: {human(site['bytes'])} from {where}")
    for w in data["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}", highlight=False)


def render_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2)


def plot(data: dict[str, Any], path: Path) -> None:
    """A stacked bar per parallelism option; PNG or SVG by the file's suffix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'trainlint[memory-plot]'") from e
    opts = list(data["options"].values())
    fig, ax = plt.subplots(figsize=(1.6 * len(opts) + 2, 4.5))
    bottoms = [0.0] * len(opts)
    names = [o["label"] for o in opts]
    tallest = max(sum(o["per_rank"][row] or 0 for row in ROWS) for o in opts)
    unit, scale = next(((u, s) for u, s in UNITS if tallest >= s), UNITS[-1])
    for row in ROWS:
        values = [(o["per_rank"][row] or 0) / scale for o in opts]
        ax.bar(names, values, bottom=bottoms, label=ROW_LABELS[row])
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for i, o in enumerate(opts):
        peak = o["peak"] if o["peak"] is not None else o.get("peak_lower_bound", 0)
        ax.plot([i - 0.4, i + 0.4], [peak / scale] * 2, color="black", linewidth=2)
    # the terms are each one's own largest value, not all alive at once: the stack can pass the peak
    ax.set_ylabel(f"{unit} per rank (black line: peak)")
    ax.set_title(f"{data['model']}, {data['precision']}, {data['optimizer']}, {data['world_size']} ranks")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
