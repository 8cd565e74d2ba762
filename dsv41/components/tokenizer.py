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
        self.vocab_size = context.config.text_config.vocab_size
        self.limit = context.config.text_config.max_position_embeddings
        self.tok = context.tokenizer

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        match message:
            case m.Tokenize(images=images) if images:
                raise m.MessageError(m.ErrorCode.INVALID_REQUEST, "image inputs are not supported yet: the "
                                     "vision tower is not built; send text only")
            case m.Tokenize():
                # the socket bounds the text to a few bytes per context token, so encoding it costs
                # little; only the token count says whether it fits
                ids = encode(self.tok, message.text)
                if len(ids) > self.limit:
                    raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"a text of {len(message.text)} characters "
                                         f"cannot fit the context of {self.limit} tokens: it is {len(ids)} tokens")
                reply(m.Tokens(request_id=message.request_id, ids=m.pack_ids(ids)))
            case m.Detokenize():
                text = decode(self.tok, m.unpack_ids(message.ids, self.vocab_size))
                reply(m.Detokenized(request_id=message.request_id, text=text))
