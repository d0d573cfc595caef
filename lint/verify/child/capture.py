"""What a probe program computed: hit counters, recorded scalars, token counts, gradients, parameters,
and the optimizer steps of a loop run. Programs feed it through ``__tl__`` calls; drivers read it."""

from __future__ import annotations

import re

import torch

# Reset by ``sandbox.exec_program`` before each program; mutated in place, never rebound, so that
# other modules may hold them.
hit_counts: dict[str, int] = {}
records: dict[str, list] = {}
tokens_seen: dict[int, int] = {}  # targets each mean-reduced loss averaged over, per microbatch
batch_valid: dict[int, int] = {}  # valid tokens of each synthetic microbatch, as built
current_loop: dict = {}  # the loop run being recorded (``begin_run``)
# stand-ins used for names of modules the child cannot import: origin -> names (``standins.Missing``);
# read and reset by the verdict (``compare.result``), reset again before each probe's programs
stood_in: dict[str, list[str]] = {}
sized_by_pattern: dict[str, float] = {}  # settings sized from the shape of their names (``standins.arg``)
entry: list[str] = []  # how the program that ran reaches the flagged code (``entry_notes``)


def entry_notes(notes: list[str]) -> None:
    """The running program's entry and the settings it made; the probe has several programs (entries
    at different depths) and only the one that runs is named in the detail."""
    entry[:] = notes


_micro = 0
_counting = False


def hit(key: str, value=None):
    hit_counts[key] = hit_counts.get(key, 0) + 1
    return value


def count(key: str) -> None:
    hit_counts[key] = hit_counts.get(key, 0) + 1


def record(key: str, value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        records.setdefault(key, []).append(float(value))
    else:
        records.setdefault(key, []).append(None)
    return value


def begin_micro(i: int) -> None:
    global _micro
    _micro = i


def counting_pass(on: bool) -> None:
    global _counting
    _counting = on
    if on:
        tokens_seen.clear()


def token_weight() -> float:
    """This microbatch's share of the window's valid tokens (as counted by its loss)."""
    counts = {i: tokens_seen.get(i, batch_valid.get(i, 0)) for i in batch_valid}
    total = sum(counts.values())
    return counts.get(_micro, 0) / total if total else 0.0


def install_token_counter() -> None:
    """Count the targets each mean-reduced cross-entropy averages over (per microbatch)."""
    functional = torch.nn.functional
    for name in ("cross_entropy", "nll_loss"):
        original = getattr(functional, name)

        def counted(input, target, *args, _original=original, **kwargs):
            reduction = kwargs.get("reduction", "mean")
            ignore = kwargs.get("ignore_index", -100)
            if (
                _counting
                and reduction == "mean"
                and isinstance(target, torch.Tensor)
                and not target.is_floating_point()
            ):
                tokens_seen[_micro] = tokens_seen.get(_micro, 0) + int((target != ignore).sum())
            return _original(input, target, *args, **kwargs)

        setattr(functional, name, counted)


def tensors_in(value, prefix: str = "out") -> list[tuple[str, torch.Tensor]]:
    """Every floating tensor in an output (tensor, tuple, list, dict, dataclass-like object)."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            out.append((prefix, value))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            out.extend(tensors_in(v, f"{prefix}[{i}]"))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.extend(tensors_in(v, f"{prefix}[{k!r}]"))
    elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module | type):
        for k, v in vars(value).items():
            if not k.startswith("_"):
                out.extend(tensors_in(v, f"{prefix}.{k}"))
    return out


def projection_loss(outputs: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """A scalar that depends on every output element with fixed random weights (so that no
    gradient is accidentally symmetric)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    total = None
    for _, t in outputs:
        if not t.requires_grad:
            continue
        w = torch.randn(t.shape, generator=gen).to(t.device)
        term = (t.float() * w).sum()
        total = term if total is None else total + term
    return total


def named_parameters(roots: dict[str, object]) -> dict[str, torch.nn.Parameter]:
    out: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for root_name, root in roots.items():
        modules = root if isinstance(root, list | tuple) else [root]
        for i, mod in enumerate(modules):
            if not isinstance(mod, torch.nn.Module):
                continue
            label = root_name.removeprefix("__tl_arg_")
            base = label if len(modules) == 1 else f"{label}[{i}]"
            for name, p in mod.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out[f"{base}.{name}" if base != "self" else name] = p
    return out


def detached(t: torch.Tensor | None):
    return None if t is None else t.detach().float().cpu().clone()


def snapshot(model: torch.nn.Module) -> dict:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def state_of(roots: dict) -> dict:
    """Buffers and plain attributes of the stand-in modules (to show state that changed)."""
    out = {}
    for root_name, root in roots.items():
        if isinstance(root, torch.nn.Module):
            for name, buf in root.named_buffers():
                if buf.is_floating_point():
                    out[f"{root_name}.{name}"] = detached(buf)
            for mod_name, mod in root.named_modules():
                for key, value in vars(mod).items():
                    if key.startswith("_") or key == "training":
                        continue
                    if isinstance(value, bool | int | float):
                        out[f"{root_name}.{mod_name + '.' if mod_name else ''}{key}"] = torch.tensor(
                            float(value)
                        )
                    elif isinstance(value, list | dict | set):
                        out[f"{root_name}.{mod_name + '.' if mod_name else ''}{key} (length)"] = torch.tensor(
                            float(len(value))
                        )
    return out


def begin_run(model, overflow_iteration: int | None = None) -> None:
    """Start recording a loop run on ``model`` (the tiny model whose parameters are compared)."""
    current_loop.clear()
    current_loop.update(
        names={id(p): n for n, p in model.named_parameters()},
        model=model,
        iteration=0,
        loss_calls=0,
        steps=[],
        overflow=overflow_iteration,
        before_overflow=None,
        census=[],
        forwards=0,
        allreduces=0,
    )


def iteration(t: int) -> None:
    current_loop["iteration"] = t
    if current_loop.get("overflow") == t and current_loop.get("before_overflow") is None:
        current_loop["before_overflow"] = snapshot(current_loop["model"])


def watch(optimizer, label: str = "optimizer"):
    """Record the gradients an optimizer applies each time it really steps (a GradScaler that skips
    a step never calls it)."""
    if not hasattr(optimizer, "register_step_pre_hook"):
        return optimizer

    def pre(opt, args, kwargs):
        names = current_loop.get("names", {})
        grads = {}
        for group in opt.param_groups:
            for p in group["params"]:
                grads[f"grad of {names.get(id(p), f'parameter {len(grads)}')}"] = detached(p.grad)
        current_loop.setdefault("steps", []).append(
            {
                "optimizer": label,
                "iteration": current_loop.get("iteration", 0),
                "forwards": current_loop.get("forwards", 0),
                "allreduces": current_loop.get("allreduces", 0),
                "grads": grads,
            }
        )

    optimizer.register_step_pre_hook(pre)
    return optimizer


def loop_result(ns: dict) -> dict:
    model = current_loop.get("model")
    params = snapshot(model) if model is not None else {}
    return {
        "before": ns.get("__tl_before__", {}),
        "after": params,
        "before_overflow": current_loop.get("before_overflow"),
        "steps": list(current_loop.get("steps", [])),
        "census": list(current_loop.get("census", [])),
        "iterations": ns.get("__tl_iterations__"),
        "loss_calls": current_loop.get("loss_calls", 0),
    }


def module_grads(ns: dict, unwrap=None) -> dict:
    """Gradients of the modules a program lists in ``__tl_modules__`` (``unwrap`` takes a wrapper
    such as DDP off first), named without the module's index."""
    modules = ns.get("__tl_modules__", [])
    params = named_parameters({f"m{i}": unwrap(m) if unwrap else m for i, m in enumerate(modules)})
    return {f"grad of {n.split('.', 1)[1]}": detached(p.grad) for n, p in params.items()}


# --------------------------------------------------------------------------------------------------
# the harness's own objects, as the user's code knows them

_PROGRAM_FILE = "<trainlint-probe-"  # the file name ``sandbox.exec_program`` gives a probe program
_UNNAMED = "a stand-in the probe built (it has only what the probe uses)"


def in_user_terms(exc: BaseException, text: str) -> str:
    """``text`` (an exception of the user's code, described) with any stand-in the harness built named
    as the user's thing it stood for (a name that cannot be imported, a setting, ``accelerator``),
    never as a class of the child (``trainlint_verify_child.standins.Missing is not a Module
    subclass``, ``'Backward' object has no attribute ...``): the detail leads with that thing."""
    package = __package__ or __name__.rpartition(".")[0]
    if package not in text and not _harness_type_named(exc, text, package):
        return text
    try:
        obj = _harness_object(exc, text, package)
        said = _said(obj, exc) if obj is not None else _UNNAMED
    except Exception:  # a local whose class misbehaves: say the stand-in without naming it
        obj, said = None, _UNNAMED
    plain = re.sub(rf"<class '{re.escape(package)}[\w.]*'>|{re.escape(package)}[\w.]*", "the stand-in", text)
    if obj is not None:
        plain = plain.replace(f"'{type(obj).__name__}' object", "the stand-in")
    if "is not a Module subclass" in text:
        return f"{said} was used as a module: {plain}"
    if isinstance(exc, AttributeError) and getattr(exc, "name", None):
        return f"{said} was asked for `{exc.name}`, which the stand-in does not have: {plain}"
    return f"{said} did not fit how the code uses it: {plain}"


def _is_harness(value, package: str) -> bool:
    return str(type(value).__module__).startswith(package + ".")


def _names_class(text: str, cls: type, package: str) -> bool:
    name = re.escape(cls.__name__)
    return re.search(rf"{re.escape(package)}[\w.]*\.{name}\b|'{name}' object", text) is not None


def _harness_type_named(exc: BaseException, text: str, package: str) -> bool:
    obj = getattr(exc, "obj", None) if isinstance(exc, AttributeError) else None
    return obj is not None and _is_harness(obj, package) and _names_class(text, type(obj), package)


def _harness_object(exc: BaseException, text: str, package: str):
    """The harness object the exception is about: an ``AttributeError``'s own object, else the
    innermost local of the traceback that is one whose class the message names."""
    obj = getattr(exc, "obj", None) if isinstance(exc, AttributeError) else None
    if obj is not None and _is_harness(obj, package):
        return obj
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if _is_harness(value, package) and _names_class(text, type(value), package):
                return value
    return None


def _hidden(obj, attr: str):
    try:
        return object.__getattribute__(obj, attr)
    except AttributeError:
        return None


def _said(obj, exc: BaseException) -> str:
    """The user's thing a harness object stands for, with what it is."""
    name = _hidden(obj, "_tl_name") or _hidden(obj, "_tl_base")
    origin = _hidden(obj, "_tl_origin")
    if name and origin:
        shown = name[:-2] + "(...)" if name.endswith("()") else name
        return f"`{shown}` (a stand-in for what cannot be imported: {origin})"
    name = name or _program_name(obj, exc)
    return f"`{name}` (a stand-in the probe built, with only what the probe uses)" if name else _UNNAMED


def _program_name(obj, exc: BaseException) -> str | None:
    """The name the probe program binds ``obj`` to (``accelerator``, ``self.accelerator``)."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.startswith(_PROGRAM_FILE):
            for scope in (frame.f_locals, frame.f_globals):
                for key, value in scope.items():
                    if value is obj:
                        return key.removeprefix("__tl_arg_")
                    if key == "self" and id(obj) in _attributes(value):
                        return f"self.{_attributes(value)[id(obj)]}"
        tb = tb.tb_next
    return None


def _attributes(value) -> dict:
    """``value``'s attributes by identity: object -> attribute name."""
    try:
        items = vars(value).items()
    except TypeError:
        return {}
    return {id(v): k for k, v in items if not k.startswith("_")}
