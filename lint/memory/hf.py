"""``--hf CONFIG``: a Hugging Face model from its configuration alone (a local path; nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainlint.memory.train import SetupError


def hf_factory(config: str) -> tuple[Callable[[], Any], int | None]:
    """A factory building the model from ``config`` (a folder with config.json, or the file), its vocab size."""
    try:
        import transformers
    except ImportError as e:
        raise SetupError("--hf needs transformers (pip install transformers); use --model otherwise") from e
    try:
        cfg = transformers.AutoConfig.from_pretrained(config, local_files_only=True)
    except Exception as e:  # missing file, bad JSON, unknown model type: say which
        raise SetupError(f"cannot read the Hugging Face config {config!r}: {type(e).__name__}: {e}") from e

    def build() -> Any:
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            try:
                return auto.from_config(cfg)
            except ValueError:  # this config has no class for that head
                continue
        raise SetupError(f"transformers has no model class for {type(cfg).__name__}")

    return build, getattr(cfg, "vocab_size", None)
