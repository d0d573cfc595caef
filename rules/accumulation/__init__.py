"""TL3xx: gradient accumulation and the loss (normalisation over the accumulation window)."""
