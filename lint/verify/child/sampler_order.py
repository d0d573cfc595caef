"""The ``sampler_order`` driver (TL505): the orders a sampler yields in two epochs, as written and
with ``set_epoch``. Confirmed when the written program repeats its order and the fixed one does not."""

from __future__ import annotations

from .compare import note_text, result
from .sandbox import exec_program


def drive_sampler_order(probe: dict) -> dict:
    orders = {}
    for name in ("as_written", "fixed"):
        ns = exec_program(probe["programs"][name], name)
        orders[name] = [[int(i) for i in epoch] for epoch in ns["__tl_orders__"]]
    written, fixed = orders["as_written"], orders["fixed"]
    notes = note_text(probe.get("notes", []))
    evidence = {"as_written": written, "with_set_epoch": fixed}
    if written[0] != written[1]:
        return result(
            "not-reproduced", f"the order changes between epochs as written: {written}{notes}", evidence
        )
    if fixed[0] == fixed[1]:
        return result(
            "not-reproduced", f"the order is the same in every epoch even with set_epoch{notes}", evidence
        )
    return result(
        "confirmed",
        f"epochs 0 and 1 both draw {written[0]}; with set_epoch epoch 1 draws {fixed[1]}{notes}",
        evidence,
    )
