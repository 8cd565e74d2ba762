"""Training a dsv41 model on the CPU with the same network code that serves it (docs/training.md)."""
