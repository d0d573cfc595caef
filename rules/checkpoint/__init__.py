"""TL2xx: activation checkpointing (``torch.utils.checkpoint``)."""
