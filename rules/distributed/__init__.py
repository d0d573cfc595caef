"""TL5xx: data parallelism (gradient synchronisation during accumulation, global token normalisation)."""
