"""Hugging Face checks at run time: TL205 (``gradient_checkpointing_enable`` called without
``gradient_checkpointing_kwargs``, where transformers chose the reentrant variant and the checkpointed
layers' trainable parameters got no gradient).

transformers is imported by the user's script, after the monitor is installed: a finder on
``sys.meta_path`` patches ``PreTrainedModel.gradient_checkpointing_enable`` once
``transformers.modeling_utils`` has loaded (directly when it already has). The patched method notes
where it was called, with which kwargs, and the ``use_reentrant`` the layers' checkpoint functions
carry; at the first optimizer step after it, the layers' trainable parameters without a gradient are
counted.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from trainlint.run.monitor import Monitor, user_location

TARGET = "transformers.modeling_utils"


@dataclass
class Enabled:
    where: tuple[str, int]
    kwargs_given: bool
    checked: bool = False


def install(monitor: Monitor) -> None:
    models: weakref.WeakKeyDictionary[Any, Enabled] = weakref.WeakKeyDictionary()

    def make_enable(original: Any) -> Any:
        def gradient_checkpointing_enable(
            model: Any, gradient_checkpointing_kwargs: Any = None, **kw: Any
        ) -> Any:
            models[model] = Enabled(user_location(), gradient_checkpointing_kwargs is not None)
            return original(model, gradient_checkpointing_kwargs, **kw)

        return gradient_checkpointing_enable

    def patch(module: Any) -> None:
        owner = getattr(module, "PreTrainedModel", None)
        if owner is not None and hasattr(owner, "gradient_checkpointing_enable"):
            monitor.patch(owner, "gradient_checkpointing_enable", make_enable)

    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    else:
        finder = _AfterImport(patch)
        sys.meta_path.insert(0, finder)
        monitor._handles.append(finder)  # uninstall calls remove()
    monitor.on_step_pre.append(lambda opt, info: _lost_gradients(monitor, models))
    monitor.on_reset.append(models.clear)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.modeling_utils`` as the other finders would, and runs ``then`` on the
    module right after it executed."""

    def __init__(self, then: Any) -> None:
        self.then = then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original, then = loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            original(module)
            then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _checkpointed(model: Any) -> list[tuple[Any, Any]]:
    out = []
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is not None:
            out.append((module, getattr(func, "keywords", {}).get("use_reentrant")))
    return out


def _lost_gradients(monitor: Monitor, models: weakref.WeakKeyDictionary[Any, Enabled]) -> None:
    for model, enabled in list(models.items()):
        if enabled.checked or enabled.kwargs_given:
            continue
        enabled.checked = True
        layers = _checkpointed(model)
        modes = {mode for _, mode in layers}
        if True not in modes:
            continue
        trainable = [p for module, _ in layers for p in module.parameters() if p.requires_grad]
        lost = sum(p.grad is None for p in trainable)
        if not lost:
            continue
        monitor.record(
            "TL205",
            f"gradient_checkpointing_enable() without kwargs: transformers checkpointed {len(layers)} "
            f"layers with use_reentrant=True, and at the first optimizer step {lost} of the "
            f"{len(trainable)} trainable parameter tensors inside them had no gradient",
            {
                "use_reentrant": sorted(str(m) for m in modes),
                "checkpointed_layers": len(layers),
                "trainable_inside": len(trainable),
                "without_grad": lost,
            },
            where=enabled.where,
        )
