"""tokenizer: text -> token ids and back; images -> their spans (the E of EPD: tokenization and ViT).

A `Tokenize` may carry encoded image files as uint8 tensor frames (the bytes of a PNG, JPEG, ...;
never a URL: nothing is fetched). Each image fills one image placeholder token of the prompt, in
order (a prompt without placeholders gets them in front); it is checked and preprocessed as the
official image processor does, run through the ViT and the aligner, and its placeholder becomes its
span. The reply carries the expanded ids and each span's rows [n, hidden] bf16 as tensor frames,
for the encoder's prefill. A bad image fails its request alone with INVALID_REQUEST.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41 import messages as m
from dsv41.components.context import ComponentContext
from dsv41.components.limits import MAX_REQUEST_IMAGE_BYTES
from dsv41.components.runtime import Component, Reply
from dsv41.model.image_processor import ImageError, expand_prompt, load_images
from dsv41.model.tokenizer import decode, encode
from dsv41.model.vision import DELIMITERS, attach_vision, encode_images

NO_TOWER = "this model has no vision tower (vision_config.num_hidden_layers is 0); send text only"


def vision_tower(context: ComponentContext) -> nn.Module | None:
    """The model's ViT, aligner and span delimiters, or None for a model without a vision tower.
    From a checkpoint only the vision tensors are read; random weights come from building the whole
    model with the pipeline's seed (so they are the values the encoder's model holds)."""
    config = context.config
    if config.vision_config.num_hidden_layers == 0:
        return None
    tower = nn.Module()
    if context.checkpoint_dir is None:
        model = context.build_model()
        tower.vision, tower.aligner = model.vision, model.aligner
        for name in DELIMITERS.values():
            tower.register_parameter(name, getattr(model, name))
        return tower.eval()
    from dsv41.checkpoint import CheckpointError, read_tensors, weight_files

    attach_vision(tower, config)
    params = dict(tower.named_parameters())
    stored = read_tensors(weight_files(context.checkpoint_dir), list(params))
    problems = [f"{name}: missing from the checkpoint" for name in params if name not in stored]
    problems += [f"{name}: shape {tuple(stored[name].shape)}, the model expects {tuple(p.shape)}"
                 for name, p in params.items() if name in stored and stored[name].shape != p.shape]
    if problems:
        raise CheckpointError(str(context.checkpoint_dir), problems)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(stored[name].to(p.dtype))  # bf16 norms held in fp32: exact
    return tower.eval()


class TokenizerComponent(Component):
    name = "tokenizer"
    accepts = frozenset({m.KIND.TOKENIZE, m.KIND.DETOKENIZE})

    def __init__(self, context: ComponentContext):
        super().__init__()
        config = context.config
        self.vocab_size = config.text_config.vocab_size
        self.limit = config.text_config.max_position_embeddings
        self.image_token_id, self.vision_config = config.image_token_id, config.vision_config
        self.tok = context.tokenizer
        self.tower = vision_tower(context)

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        match message:
            case m.Tokenize():
                ids = self._ids(message)
                if message.image_data or message.images:
                    reply(*self._with_images(message, ids, frames))
                else:
                    reply(m.Tokens(request_id=message.request_id, ids=m.pack_ids(ids)))
            case m.Detokenize():
                text = decode(self.tok, m.unpack_ids(message.ids, self.vocab_size))
                reply(m.Detokenized(request_id=message.request_id, text=text))

    def _ids(self, message: m.Tokenize) -> list[int]:
        # the socket bounds a text to a few bytes per context token, so encoding it costs little;
        # only the token count says whether it fits
        ids = m.unpack_ids(message.ids, self.vocab_size) if message.ids else encode(self.tok, message.text)
        if len(ids) > self.limit:
            what = f"{len(ids)} token ids" if message.ids else f"a text of {len(message.text)} characters"
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{what} cannot fit the context of {self.limit} "
                                 f"tokens: it is {len(ids)} tokens")
        return ids

    def _with_images(self, message: m.Tokenize, ids: list[int], frames: list[memoryview]):
        """The prompt with its image placeholders expanded, and each span's rows as tensor frames."""
        if self.tower is None:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, NO_TOWER)
        data = message.image_data
        if message.images and message.images != len(data):
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{message.images} images announced but "
                                 f"{len(data)} sent")
        if any(d.dtype != "uint8" or len(d.shape) != 1 for d in data):
            raise m.MessageError(m.ErrorCode.BAD_TENSOR, "images travel as 1-D uint8 tensors of encoded file bytes")
        if sum(d.nbytes for d in data) > MAX_REQUEST_IMAGE_BYTES:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{sum(d.nbytes for d in data)} bytes of images in "
                                 f"one request; the limit is {MAX_REQUEST_IMAGE_BYTES}")
        try:
            images = load_images([bytes(frames[d.frame]) for d in data], self.vision_config)
            if self.image_token_id not in ids:
                ids = [self.image_token_id] * len(images) + ids
            expanded = expand_prompt(ids, images, self.image_token_id)
        except ImageError as e:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, str(e)) from None
        if len(expanded.ids) > self.limit:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"with its images the prompt is {len(expanded.ids)} "
                                 f"tokens; the context holds {self.limit}")
        spans = encode_images(self.tower, expanded)
        self.counters.update(images=len(images), image_tokens=sum(s.rows.size(0) for s in spans))
        out = m.Frames()
        return m.Tokens(request_id=message.request_id, ids=m.pack_ids(expanded.ids),
                        spans=[out.add(s.rows) for s in spans], span_starts=[s.start for s in spans]), out
