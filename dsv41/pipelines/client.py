"""The client side of a pipeline: send a `Generate` to the dspark component, read the stream."""

from __future__ import annotations

from collections.abc import Iterator

from dsv41 import messages as m
from dsv41.components.runtime import Peer, new_request_id


def generate(peer: Peer, prompt: str = "", ids: list[int] | None = None, timeout_s: float | None = None,
             **options) -> Iterator[m.TokenEvent | m.Finished]:
    """Token events, then one `Finished`; raises ComponentError when the request fails."""
    request = m.Generate(request_id=new_request_id(), prompt=prompt, ids=m.pack_ids(ids) if ids else b"", **options)
    yield from peer.stream(request, timeout_s)
