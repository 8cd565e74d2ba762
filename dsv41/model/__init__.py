"""The network in plain torch; `reference.py` is the oracle every fast path is tested against."""
