"""The largest legitimate message of each kind, computed from the model config and the pipeline.

A hostile size header must cost nothing, so every socket's ZMQ_MAXMSGSIZE is the largest message it
can legitimately receive (ZeroMQ checks it per frame, before allocating, and drops the connection),
and `messages.decode` holds each message to its own kind's size with a TOO_LARGE error reply. The
sizes are upper bounds per token times the most tokens a message can carry:

| messages | most tokens | bytes per token |
|---|---|---|
| prompts and generated text (Generate, Tokenize, Detokenized) | context L | 4 (UTF-8) |
| token ids (Tokens, Detokenize, Prefill, Lookup, EngramPrefetch) | L | 4 |
| Step / BatchStep | k = dspark_block_size + 1, times 256 requests | 4 |
| DecoderPrefill | L of global KV + R replayed streams | global KV + streams |
| DecoderStep / Logits | max(chunk_size, k, W) (W: a prefill's DSpark input) | streams / logits + DSpark input |
| DecoderBatchStep / BatchLogits | 256 k | streams / logits + DSpark input |
| EngramRows | L | Engram rows |
| PutBlocks / Blocks / LookupResult | 61 blocks, a snapshot, L/16 keys | block payload |

R = W + (decoder layers - 1)(W - 1), the `exact` replay of the decoder (W: sliding window). Streams
count hc x hidden fp32 values plus the fp32 mix (the real streams are bf16), logits fp32 over the
vocabulary. Every kind gets OVERHEAD on top for its msgpack fields, and none more than the protocol's
largest tensor (2 GiB). Socket limits that follow (MiB, the largest kind each socket receives):

| config | tokenizer, dspark, engram | kvstore | encoder | decoder |
|---|---|---|---|---|
| micro (4K context) | 0.08 | 1.3 | 3.1 (EngramRows) | 1.3 |
| mini (1M context) | 4.06 | 16.7 | 768 (EngramRows) | 900 (DecoderPrefill) |
| official (1M context) | 4.06 | 16.7 | 2048 (EngramRows, capped) | 1089 (DecoderPrefill) |

An official prompt over about 87K tokens has more Engram rows than the cap: the engram component
cannot push them and the encoder looks them up itself after `rows_timeout_s`.

A model with a vision tower adds images: Generate and Tokenize carry up to MAX_REQUEST_IMAGE_BYTES of
encoded image files, Tokens and Prefill the span rows (bf16, hidden wide) of at most
min(L, 16 x max_image_tokens) positions.
"""

from __future__ import annotations

import math

from dsv41 import messages as m
from dsv41.config import ModelConfig, Part, global_kv_bytes_per_token
from dsv41.pipelines.schema import Pipeline

OVERHEAD = 64 << 10  # msgpack fields around the payload: ids, counters, descriptors, error texts
MAX_REQUEST_IMAGE_BYTES = 64 << 20  # encoded image files of one request, together
KEY_BYTES = 34  # a 32-byte chain key in msgpack
BLOCK_HEADER = 64


def step_tokens(config: ModelConfig) -> int:
    """Most tokens one Step may carry: the last token and a drafted block to verify."""
    return config.text_config.dspark_block_size + 1


def snapshot_bytes(config: ModelConfig) -> int:
    """Bytes of the encoder's SWA rings (the host pool's snapshot), measured on a one-position cache."""
    from dsv41.model.cache import DecodeCache, encoder_rings

    encoder = [s.layer_id for s in config.plan.backbone if s.part is Part.ENCODER]
    return len(encoder_rings(DecodeCache.allocate(config, 1, 1, packed=True, layers=set(encoder)), encoder))


def pipeline_limits(config: ModelConfig, pipeline: Pipeline) -> m.Limits:
    """Limits of every kind of message for `pipeline` running `config` (see the module's table)."""
    t = config.text_config
    context = min(t.max_position_embeddings, m.MAX_TOKENS)
    k, batch = step_tokens(config), m.MAX_BATCH
    chunk = min(pipeline.generation.chunk_size, context)
    decoder_layers = sum(s.part is Part.DECODER for s in config.plan.backbone)
    window = t.sliding_window
    replay = min(context, window + (decoder_layers - 1) * (window - 1))

    ids, text = 4 * context, m.TEXT_BYTES_PER_TOKEN * context
    stream = t.hc_mult * t.hidden_size * 4 + t.hc_mult * 4
    logits = t.vocab_size * 4 + 3 * t.hidden_size * 4
    kv = math.ceil(global_kv_bytes_per_token(config))
    engram = len(t.engram_layer_ids) * (t.engram_max_ngram_size - 1) * t.engram_n_heads * t.engram_head_dim * 2
    keys = context // 16 * KEY_BYTES
    block = pipeline.store.block_tokens * kv + BLOCK_HEADER
    snapshot = snapshot_bytes(config)

    payload = {
        m.KIND.GENERATE: max(text, ids), m.KIND.TOKENIZE: text, m.KIND.DETOKENIZED: text,
        m.KIND.TOKENS: ids, m.KIND.DETOKENIZE: ids, m.KIND.PREFILL: ids, m.KIND.LOOKUP: ids,
        m.KIND.ENGRAM_PREFETCH: ids,
        m.KIND.STEP: 4 * k, m.KIND.BATCH_STEP: batch * (4 * k + 16),
        m.KIND.DECODER_PREFILL: context * kv + replay * stream,
        m.KIND.DECODER_STEP: max(chunk, k) * stream, m.KIND.LOGITS: max(chunk, k, window) * logits,
        m.KIND.DECODER_BATCH_STEP: batch * k * stream, m.KIND.BATCH_LOGITS: batch * (k * logits + 4096),
        m.KIND.ENGRAM_ROWS: context * engram,
        m.KIND.LOOKUP_RESULT: keys + snapshot, m.KIND.GET_BLOCKS: keys,
        m.KIND.BLOCKS: (m.MAX_FRAMES - 2) * block, m.KIND.PUT_BLOCKS: keys + (m.MAX_FRAMES - 3) * block + snapshot,
    }
    if config.vision_config.num_hidden_layers:
        span_rows = min(context, m.MAX_SPANS * config.vision_config.max_image_tokens) * t.hidden_size * 2
        for kind, extra in ((m.KIND.GENERATE, MAX_REQUEST_IMAGE_BYTES), (m.KIND.TOKENIZE, MAX_REQUEST_IMAGE_BYTES),
                            (m.KIND.TOKENS, span_rows), (m.KIND.PREFILL, span_rows)):
            payload[kind] = max(payload[kind], ids) + extra
    return m.Limits({kind: min(OVERHEAD + payload.get(kind, 0), m.MAX_TENSOR_BYTES) for kind in m.KIND})
