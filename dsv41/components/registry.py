"""Component name -> class, imported on demand (a tokenizer process never imports the model)."""

from __future__ import annotations

from importlib import import_module

from dsv41.components.runtime import Component

_CLASSES = {
    "tokenizer": "dsv41.components.tokenizer:TokenizerComponent",
    "engram": "dsv41.components.engram:EngramComponent",
    "encoder": "dsv41.components.encoder:EncoderComponent",
    "decoder": "dsv41.components.decoder:DecoderComponent",
    "dspark": "dsv41.components.dspark:DSparkComponent",
    "kvstore": "dsv41.components.kvstore:KVStoreComponent",
}


def component_class(name: str) -> type[Component]:
    if name not in _CLASSES:
        raise ValueError(f"unknown component {name!r}; expected one of {', '.join(_CLASSES)}")
    module, cls = _CLASSES[name].split(":")
    return getattr(import_module(module), cls)
