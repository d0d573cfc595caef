"""TL4xx: measuring memory and time honestly (peak counters, asynchronous CUDA, lazy optimizer state)."""
