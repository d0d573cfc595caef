"""trainlint: a static analyzer for PyTorch training code (engine package)."""

__version__ = "0.1.0"
