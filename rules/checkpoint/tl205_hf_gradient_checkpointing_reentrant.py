"""TL205 hf-gradient-checkpointing-reentrant."""

from __future__ import annotations

import re
from collections.abc import Iterator

import libcst as cst

from trainlint.api import Applicability, Diagnostic, FixSpec, Invalid, Rule, RuleDoc, Severity, TextEditSpec
from trainlint.model import FileModel, Site, attr_name, dotted, has_star_kwargs, keyword, literal_false
from trainlint.model.pins import Pin, lowest_allowed_at_least
from trainlint.model.vocab import INPUT_GRAD_FIXES

KWARGS = "gradient_checkpointing_kwargs"
# The first transformers release whose `gradient_checkpointing_enable()` defaults to
# `use_reentrant=False` (pull request 43203; 4.57.6 and 5.0.0rc3 still pass True).
FIXED_RELEASE = (5, 0, 0)
FIX_TEXT = 'gradient_checkpointing_kwargs={"use_reentrant": False}'
# Signs that some parameters are frozen: only then does the reentrant variant lose gradients.
# Freezing a whole module is not one (a frozen text encoder has nothing to lose); freezing the
# embedding under trained layers is.
FROZEN = re.compile(
    r"(?<![A-Za-z])(peft|lora|LoRA|Lora|adapter)|embed\w*[\s\\()]*(\.\s*weight)?\s*\.[\s(]*requires_grad_?[\s\\()=]*False",
    re.ASCII,
)
# A branch taken only without adapters (`if args.train_text_encoder and not args.use_lora:`).
WITHOUT_ADAPTERS = re.compile(
    r"not[\s(]+[\w.]*(lora|peft|adapter|oft|hra|deft)|==\s*['\"]full['\"]", re.IGNORECASE
)
HF_PACKAGES = ("transformers.", "peft.", "trl.")
# Argument classes of transformers and TRL that take gradient_checkpointing=True.
# transformers' argument classes; TRL's configs are not reported, since TRL's trainers default
# `use_reentrant` to False themselves.
ARGUMENT_CLASS = re.compile(r"TrainingArguments$")


class HfGradientCheckpointingReentrant(Rule):
    id = "TL205"
    name = "hf-gradient-checkpointing-reentrant"
    severity = Severity.WARNING
    probe = True
    summary = (
        "Hugging Face gradient checkpointing enabled without gradient_checkpointing_kwargs on a model "
        "with frozen parameters: transformers picks the reentrant variant."
    )
    # Every finding is a `gradient_checkpointing_enable` call or a `gradient_checkpointing=True`
    # keyword, in a file with a sign of frozen parameters (the FROZEN pattern).
    tokens = ("gradient_checkpointing",)
    requires = (FROZEN,)
    # A bare `gradient_checkpointing_enable()` or a `...TrainingArguments(gradient_checkpointing=...)`
    # without the kwargs, in a file whose identifiers name no input-grad fix.
    gate_check = "gate_checkpoint_misc.hf_checkpointing_may_lack_kwargs"
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `model.gradient_checkpointing_enable()` called without arguments, and "
            "`TrainingArguments(...)` / TRL `...Config(...)` with `gradient_checkpointing=True` and no "
            "`gradient_checkpointing_kwargs`, in a file that trains adapters (PEFT/LoRA, adapters) or "
            "freezes an embedding, unless the call only runs without adapters (`if ... not "
            "args.use_lora:`). TRL's configs are not reported: TRL's trainers default `use_reentrant` "
            "to False. A file that calls `enable_input_require_grads()` or PEFT's "
            "`prepare_model_for_kbit_training` (which calls it), or sets `gradient_checkpointing_kwargs` "
            "anywhere (`args.gradient_checkpointing_kwargs = {...}`), is not reported; nor is a call "
            "before `get_peft_model` (PEFT then makes the inputs require grad), nor one on a model "
            "built by a class or factory imported from another package than transformers/PEFT/TRL "
            "(its own `gradient_checkpointing_enable` is not in the file). Nor is a file whose project "
            "(the folder the index finds) requires `transformers>=5.0.0` in every place it declares it "
            "(`requirements*.txt`, `pyproject.toml`, `setup.cfg`, `setup.py`): those releases no longer "
            "pick the reentrant variant. A project that declares no requirement, or one that admits "
            "earlier releases (`transformers>=4.40`, `==4.57.6`, a bare name), is still reported."
        ),
        why=(
            "transformers' `PreTrainedModel.gradient_checkpointing_enable` replaces a missing "
            '`gradient_checkpointing_kwargs` with `{"use_reentrant": True}` (modeling_utils.py, '
            "huggingface/transformers at 040ba146; it calls `enable_input_require_grads()` only for "
            "adapters loaded through transformers' own PEFT integration), and the Trainer passes "
            "`args.gradient_checkpointing_kwargs`, None by default. The reentrant checkpoint computes "
            "gradients only for inputs that require grad: with a frozen embedding, the hidden states "
            "entering the first checkpointed layer do not, so no parameter inside any checkpointed "
            "layer gets a gradient. With LoRA on 32 checkpointed decoder layers and a trainable "
            "classification head, all 32 x 2 LoRA matrices per target keep `grad = None` and only the "
            "head trains (or, when nothing outside the layers trains, backward fails with 'element 0 "
            "of tensors does not require grad'). transformers 5.0.0 changed this (pull request 43203): "
            'it defaults a missing argument to `{"use_reentrant": False}` and calls '
            "`enable_input_require_grads()` for every model whose main input is `input_ids`, so there "
            "the call is harmless; the finding matters on 4.x (4.57.6 and the 5.0.0 release "
            "candidates still pass `use_reentrant=True`). `--verify` builds the user's model "
            "(from a configuration in the file, never `from_pretrained`) with the installed "
            "transformers and says which behaviour it has."
        ),
        example=(
            "model = AutoModelForCausalLM.from_pretrained(name)\n"
            "model = get_peft_model(model, LoraConfig(r=8))\n"
            "model.gradient_checkpointing_enable()"
        ),
        use_instead=(
            "model = AutoModelForCausalLM.from_pretrained(name)\n"
            "model = get_peft_model(model, LoraConfig(r=8))\n"
            'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'
        ),
        fix_safety=(
            'The fix adds `gradient_checkpointing_kwargs={"use_reentrant": False}` to a '
            "`gradient_checkpointing_enable()` call that has no arguments. It is safe: transformers' "
            "checkpointed layers support both variants, the non-reentrant one is what PyTorch and "
            "transformers recommend, and it computes the same gradients wherever the reentrant one "
            "computes any. `TrainingArguments` calls are not fixed automatically (add the keyword)."
        ),
        references=(
            "https://huggingface.co/docs/transformers/main_classes/model#transformers.PreTrainedModel.gradient_checkpointing_enable",
            "https://pytorch.org/docs/stable/checkpoint.html",
        ),
    )
    valid = (
        # explicit kwargs
        """
        from peft import get_peft_model
        model = get_peft_model(model, cfg)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        """,
        # the inputs are made to require grad
        """
        from peft import get_peft_model
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
        model = get_peft_model(model, cfg)
        """,
        # PEFT's k-bit preparation enables checkpointing and input grads itself
        """
        from peft import prepare_model_for_kbit_training, get_peft_model
        model = prepare_model_for_kbit_training(model)
        model = get_peft_model(model, cfg)
        model.gradient_checkpointing_enable()
        """,
        # full fine-tuning: nothing frozen, reentrant loses nothing
        """
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(name)
        model.gradient_checkpointing_enable()
        """,
        # TrainingArguments with the kwargs
        """
        from transformers import TrainingArguments
        from peft import LoraConfig
        args = TrainingArguments(out, gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs={"use_reentrant": False})
        """,
        # the kwargs set on the arguments afterwards
        """
        from trl import SFTConfig
        from peft import LoraConfig
        args = SFTConfig(out, gradient_checkpointing=True)
        args.gradient_checkpointing_kwargs = {"use_reentrant": False}
        """,
        # checkpointing off
        """
        from transformers import TrainingArguments
        from peft import LoraConfig
        args = TrainingArguments(out, gradient_checkpointing=False)
        """,
        # TRL's trainers default use_reentrant to False
        """
        from trl import SFTConfig
        from peft import LoraConfig
        args = SFTConfig(out, gradient_checkpointing=True)
        """,
        # only without adapters (diffusers' DreamBooth scripts with a fully trained text encoder)
        """
        from peft import LoraConfig
        if args.train_text_encoder and not args.use_lora:
            text_encoder.gradient_checkpointing_enable()
        """,
        # enabled before get_peft_model, which then makes the inputs require grad
        """
        from peft import get_peft_model
        model.gradient_checkpointing_enable()
        model = get_peft_model(model, cfg)
        """,
        # a branch taken only without adapters (any of several)
        """
        from peft import LoraConfig
        if args.train_text_encoder and not (args.use_lora or args.use_boft):
            text_encoder.gradient_checkpointing_enable()
        """,
        # `lora` inside another word (colorama)
        """
        from colorama import Fore
        text_encoder.gradient_checkpointing_enable()
        """,
        # a project's own model class, built in another module
        """
        from dschat.rlhf.rlhf_engine import DeepSpeedRLHFEngine
        engine = DeepSpeedRLHFEngine(actor_path, lora_dim=8)
        engine.actor.gradient_checkpointing_enable()
        """,
        # a wholly frozen module has no gradient to lose
        """
        text_encoder.requires_grad_(False)
        text_encoder.gradient_checkpointing_enable()
        """,
        # a model class's own override that forwards its argument
        """
        class Wrapper(torch.nn.Module):
            def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
                self.lora_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs)
        """,
    )
    invalid = (
        Invalid(
            """
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=8))
            # trade compute for memory
            model.gradient_checkpointing_enable()  # before training
            """,
            line=4,
            fix="""
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=8))
            # trade compute for memory
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # before training
            """,
        ),
        Invalid(
            """
            model.model.embed_tokens.weight.requires_grad = False
            model.gradient_checkpointing_enable()  # save memory
            """,
            line=2,
            fix="""
            model.model.embed_tokens.weight.requires_grad = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # save memory
            """,
        ),
        Invalid(
            """
            from transformers import TrainingArguments
            from peft import LoraConfig
            args = TrainingArguments(output_dir="out", gradient_checkpointing=True, bf16=True)
            """,
            line=3,
        ),
        Invalid(
            """
            import transformers
            peft_config = LoraConfig(r=16)
            training_args = transformers.Seq2SeqTrainingArguments(
                output_dir="out",
                gradient_checkpointing=True,
            )
            """,
            line=5,
        ),
        Invalid(
            """
            def build(model, use_lora):
                if use_lora:
                    model = add_adapter(model)
                model.model.gradient_checkpointing_enable()
                return model
            """,
            line=4,
        ),
        Invalid(
            """
            class Trainer:
                def setup(self):
                    self.model.get_input_embeddings().requires_grad_(False)
                    self.model.gradient_checkpointing_enable()
            """,
            line=4,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        source = model.source
        if any(name in source for name in INPUT_GRAD_FIXES) or FROZEN.search(source) is None:
            return
        fixed_release, pins = lowest_allowed_at_least(model.path, "transformers", FIXED_RELEASE)
        if fixed_release:
            return
        message = MESSAGE + _allowed(pins)
        sets_kwargs = _assigns_kwargs_attribute(model)
        for site in model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            if attr_name(call) == "gradient_checkpointing_enable":
                if (
                    not call.args
                    and not _inside_override(site)
                    and not _before_peft(model, site)
                    and not _built_elsewhere(model, site, call)
                    and not _without_adapters(model, site)
                ):
                    func = model.code(call.func)
                    fix = None
                    # only `f()` exactly: a comment inside the parentheses would be lost
                    if model.code(call) == f"{func}()":
                        fix = FixSpec(
                            Applicability.SAFE,
                            "Pass gradient_checkpointing_kwargs={'use_reentrant': False}",
                            (TextEditSpec(call, "replace", f"{func}({FIX_TEXT})"),),
                        )
                    yield Diagnostic(call, message, fix=fix)
            elif not sets_kwargs and _enables_in_arguments(model, site, call):
                keyword_arg = keyword(call, "gradient_checkpointing")
                assert keyword_arg is not None
                yield Diagnostic(keyword_arg, message)


MESSAGE = (
    "Gradient checkpointing without `gradient_checkpointing_kwargs`: transformers before 5.0.0 then "
    "uses `use_reentrant=True`, and with frozen parameters the checkpointed layers get no gradients; "
    'pass `gradient_checkpointing_kwargs={"use_reentrant": False}`'
)


def _allowed(pins: tuple[Pin, ...]) -> str:
    """What the project's requirements say about the version (they admit a release before 5.0.0)."""
    if not pins:
        return "."
    shown = ", ".join(f"`transformers{p.spec.split(';', 1)[0].strip()}` ({p.file})" for p in pins[:3])
    return f" (the project allows releases before 5.0.0: {shown})."


def _inside_override(site: Site) -> bool:
    """The call sits in a method itself called ``gradient_checkpointing_enable`` (a forwarding override)."""
    scope = site.scope
    return scope.kind == "function" and scope.name == "gradient_checkpointing_enable"


def _built_elsewhere(model: FileModel, site: Site, call: cst.Call) -> bool:
    """The receiver comes from a constructor or factory imported from another package than
    transformers, PEFT or TRL (a project's own model class, whose ``gradient_checkpointing_enable``
    and input handling this file does not show)."""
    root = (dotted(call.func) or "").split(".", 1)[0]
    binding = model.lookup(root, site.scope)
    if binding is None or not isinstance(binding.node, cst.Assign):
        return False
    value = binding.node.value
    if not isinstance(value, cst.Call):
        return False
    callee = model.qualname(value.func, site.scope)
    return callee is not None and not callee.startswith(("<local>", *HF_PACKAGES))


def _before_peft(model: FileModel, site: Site) -> bool:
    """``get_peft_model`` runs after the call in the same scope: PEFT then makes the inputs require
    grad itself (``PeftModel.__init__`` checks ``is_gradient_checkpointing``)."""
    return any(
        attr_name(other.node) == "get_peft_model" or dotted(other.node.func) == "get_peft_model"
        for other in model.calls_in(site.scope)
        if other.order > site.order and isinstance(other.node, cst.Call)
    )


def _without_adapters(model: FileModel, site: Site) -> bool:
    for frame in site.frames:
        if isinstance(frame.node, cst.If) and frame.branch == "body":
            if WITHOUT_ADAPTERS.search(model.code(frame.node.test)):
                return True
    return False


def _enables_in_arguments(model: FileModel, site: Site, call: cst.Call) -> bool:
    """``TrainingArguments(..., gradient_checkpointing=<not False>)`` without the kwargs or a ``**`` splat."""
    arg = keyword(call, "gradient_checkpointing")
    if arg is None or literal_false(arg) or keyword(call, KWARGS) is not None or has_star_kwargs(call):
        return False
    if isinstance(arg.value, cst.Name) and arg.value.value == "None":
        return False
    callee = model.callee(site) or ""
    name = callee.rsplit(".", 1)[-1] or (attr_name(call) or "")
    return ARGUMENT_CLASS.search(name) is not None


def _assigns_kwargs_attribute(model: FileModel) -> bool:
    """``x.gradient_checkpointing_kwargs = ...`` anywhere in the file."""
    for site in model.assigns:
        node = site.node
        targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else []
        if any(isinstance(t, cst.Attribute) and t.attr.value == KWARGS for t in targets):
            return True
    return False
