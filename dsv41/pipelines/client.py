"""The client side of a pipeline: send a `Generate` to the dspark component, read the stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from dsv41 import messages as m
from dsv41.components.runtime import Peer, new_request_id


def generate(peer: Peer, prompt: str = "", ids: list[int] | None = None, timeout_s: float | None = None,
             images: list[bytes] = (), **options) -> Iterator[m.TokenEvent | m.Finished]:
    """Token events, then one `Finished`; raises ComponentError when the request fails. `images`: encoded
    image files (PNG, JPEG, ...), one per image placeholder of the prompt (none: they go in front)."""
    frames = m.Frames()
    data = [frames.add(torch.frombuffer(bytearray(image), dtype=torch.uint8)) if image else
            frames.add(torch.empty(0, dtype=torch.uint8)) for image in images]
    request = m.Generate(request_id=new_request_id(), prompt=prompt, ids=m.pack_ids(ids) if ids else b"",
                         image_data=data, **options)
    yield from peer.stream(request, timeout_s, frames)


def generate_together(new_peer: Callable[[], Peer], requests: list[m.Generate],
                      timeout_s: float | None = None) -> list[tuple[list[int], m.Finished]]:
    """Send every request at once, each on its own peer (the dspark component then steps them as one
    batch), and read each stream to its end: the token ids and the `Finished` of each request."""
    peers = [new_peer() for _ in requests]
    out = []
    try:
        for peer, request in zip(peers, requests, strict=True):
            peer.send(request)
        for peer, request in zip(peers, requests, strict=True):
            tokens = []
            while not isinstance(event := peer.receive(request.request_id, timeout_s)[0], m.Finished):
                tokens.append(event.token)
            out.append((tokens, event))
    finally:
        for peer in peers:
            peer.close()
    return out
