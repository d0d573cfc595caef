"""The ``hf_checkpointing`` driver (TL205): the user's model construction, built twice from the same
seed, with its input embedding frozen (what adapters leave untrained), checkpointing enabled as the
user enables it and with ``{"use_reentrant": False}``; one forward and backward each, and which of the
checkpointed layers' trainable parameters got a gradient.

Confirmed when, as written, transformers chose the reentrant variant and trainable parameters inside
the checkpointed layers got no gradient, while with the keyword they all did. transformers must be
importable in the child: the probe never stands in for it.
"""

from __future__ import annotations

import importlib.util

import torch

from .compare import not_executable, note_text, result
from .sandbox import VariantFailed, call_user, exec_program, seed

FIXED_KWARGS = {"use_reentrant": False}


def _checkpointed(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """The modules transformers gave a checkpoint function, with the ``use_reentrant`` it carries."""
    out = []
    for name, module in model.named_modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is not None:
            out.append((name, module, getattr(func, "keywords", {}).get("use_reentrant", "unset")))
    return out


def _input_ids(model: torch.nn.Module) -> torch.Tensor:
    embed = model.get_input_embeddings()
    vocab = int(getattr(embed, "num_embeddings", 16))
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, 6), generator=gen)


def _variant(probe: dict, name: str, kwargs: dict | None) -> dict:
    seed(0)
    ns = exec_program(probe["programs"]["as_written"], name)
    model = ns["__tl_model__"]
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "gradient_checkpointing_enable"):
        raise VariantFailed(TypeError("the model built is not a transformers model"))
    model.get_input_embeddings().requires_grad_(False)
    if kwargs is None:
        call_user(model.gradient_checkpointing_enable)
    else:
        call_user(model.gradient_checkpointing_enable, gradient_checkpointing_kwargs=kwargs)
    model.train()
    out, _ = call_user(model, input_ids=_input_ids(model))
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
    try:
        call_user(logits.float().sum().backward)
        raised = None
    except VariantFailed as exc:  # nothing left that requires grad: the loss has no graph
        raised = str(exc)
    layers = _checkpointed(model)
    trainable = [
        (f"{n}.{p}".lstrip("."), t) for n, m, _ in layers for p, t in m.named_parameters() if t.requires_grad
    ]
    return {
        "use_reentrant": sorted({str(r) for _, _, r in layers}),
        "layers": len(layers),
        "trainable": len(trainable),
        "without_grad": [n for n, t in trainable if t.grad is None],
        "raised": raised,
    }


def drive_hf_checkpointing(probe: dict) -> dict:
    if importlib.util.find_spec("transformers") is None:
        return not_executable("transformers is not installed")
    runs = {
        "as_written": _variant(probe, "as_written", None),
        "fixed": _variant(probe, "fixed", FIXED_KWARGS),
    }
    written, fixed = runs["as_written"], runs["fixed"]
    ev = {
        name: {k: v if k != "without_grad" else len(v) for k, v in run.items()} for name, run in runs.items()
    }
    notes = note_text(probe.get("notes", []))
    if not written["layers"]:
        return not_executable("no layer of the model was checkpointed" + notes)
    lost = written["without_grad"]
    if not lost and written["raised"] is None:
        detail = (
            f"as written transformers checkpointed {written['layers']} layer(s) with use_reentrant="
            f"{', '.join(written['use_reentrant'])}, and all {written['trainable']} trainable parameter(s) "
            "inside got a gradient"
        )
        return result("not-reproduced", detail + notes, ev)
    if fixed["without_grad"] or fixed["raised"]:
        return not_executable("the layers get no gradient even with use_reentrant=False" + notes)
    shown = ", ".join(lost[:3]) + (", ..." if len(lost) > 3 else "")
    what = f"{len(lost)} of the {written['trainable']} trainable parameters inside them got no gradient ({shown})"
    if written["raised"]:
        what = f"the backward failed ({written['raised']})"
    detail = (
        f"as written transformers checkpointed {written['layers']} layer(s) with use_reentrant="
        f"{', '.join(written['use_reentrant'])} and {what}; with "
        '`gradient_checkpointing_kwargs={"use_reentrant": False}` every one got its gradient'
    )
    return result("confirmed", detail + notes, ev, fixed_matches=True)
