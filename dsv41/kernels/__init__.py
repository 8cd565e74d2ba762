"""Number-format codecs, packed KV entry layouts, and kernels (Triton on CUDA, torch twins elsewhere)."""
