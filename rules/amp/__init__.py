"""TL1xx: mixed precision and loss scaling (``torch.amp.GradScaler``, autocast, 16-bit storage)."""
