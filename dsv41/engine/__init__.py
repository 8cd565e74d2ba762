"""The single-process inference core: caches, CED/exact/full prefill, bounded replay, decode and verify."""
