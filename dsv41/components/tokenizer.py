"""tokenizer: text -> token ids and back (the E of EPD; images are refused until the vision tower)."""

from __future__ import annotations

from dsv41 import messages as m
from dsv41.components.context import ComponentContext
from dsv41.components.runtime import Component, Reply
from dsv41.model.tokenizer import decode, encode


class TokenizerComponent(Component):
    name = "tokenizer"
    accepts = frozenset({m.KIND.TOKENIZE, m.KIND.DETOKENIZE})

    def __init__(self, context: ComponentContext):
        super().__init__()
        self.tok = context.tokenizer

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        match message:
            case m.Tokenize(images=images) if images:
                raise m.MessageError(m.ErrorCode.INVALID_REQUEST, "image inputs are not supported yet: the "
                                     "vision tower is not built; send text only")
            case m.Tokenize():
                reply(m.Tokens(request_id=message.request_id, ids=m.pack_ids(encode(self.tok, message.text))))
            case m.Detokenize():
                text = decode(self.tok, m.unpack_ids(message.ids))
                reply(m.Detokenized(request_id=message.request_id, text=text))
