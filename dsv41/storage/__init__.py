"""Persistent prefix cache: block identity, block format, the LMDB store, the host SWA pool, the policy."""
