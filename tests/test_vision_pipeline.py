"""Images through the pipeline: the tokenizer/ViT component, span rows as tensor frames, prefill with
spans in the encoder and decoder, the prefix-cache chain key over image content, `dsv41 run --image`,
the OpenAI server's image_url parts, and every way an image request can be bad.

The model is `micro` with a tiny vision tower (random weights, written as a model directory); the
reference model with the same image is the oracle."""

from __future__ import annotations

import base64
import io
import shutil
import struct
import zlib

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from dsv41 import messages as m
from dsv41.checkpoint import load_model
from dsv41.components.runtime import ComponentError, Peer, new_request_id
from dsv41.config import config_from_dict, config_to_dict, load_config
from dsv41.engine.core import InferenceCore
from dsv41.engine.prefix_cache import CachedPrefill, span_extra
from dsv41.export import export_model
from dsv41.model import image_processor as ip
from dsv41.model.numerics import stable_numerics
from dsv41.model.reference import random_model
from dsv41.model.vision import encode_images
from dsv41.pipelines.client import generate
from dsv41.pipelines.launch import Supervisor, with_overrides
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.policy import PrefixCachePolicy
from dsv41.storage.prefix import Fingerprint, block_keys
from dsv41.storage.store import GlobalKVStore
from dsv41.storage.swa_pool import SWAPool
from tests.helpers.pipelines import endpoints, pipeline_for, short_dir

pytestmark = pytest.mark.timeout(300)
NEW_TOKENS = 4
BLOCK = 16


def png(w: int, h: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG that declares w x h pixels and holds none (decoding it would be the attack)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def vision_config():
    data = config_to_dict(load_config("micro"))
    data["vision_config"].update(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96,
                                 max_image_tokens=40, min_pixels=5000)
    return config_from_dict(data)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vision-model") / "tiny-vision"
    config = vision_config()
    export_model(random_model(config, seed=3), config, path)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)[0]


@pytest.fixture(scope="module")
def images():
    return {"a": png(50, 30, 1), "b": png(50, 30, 2), "tall": png(20, 90, 3)}


@pytest.fixture(scope="module")
def prompt(model):
    """18 text tokens, an image placeholder, 6 text tokens: with image "a" (a span of 10 positions) two
    complete 16-token blocks, the span starting in the second."""
    gen = torch.Generator().manual_seed(5)
    text = torch.randint(3, 300, (24,), generator=gen).tolist()
    return text[:18] + [model.config.image_token_id] + text[18:]


@pytest.fixture(scope="module")
def reference(model, images, prompt):
    """The reference with image "a": expanded ids, spans, the last prompt position's logits, greedy tokens."""
    ex, spans = expanded(model, prompt, [images["a"]])
    with torch.inference_mode():
        logits = model(torch.tensor([ex.ids]), spans=spans).logits[0, -1]
    return ex, spans, logits, reference_generate(model, ex.ids, NEW_TOKENS, spans)


def expanded(model, ids, blobs):
    out = ip.expand_prompt(ids, ip.load_images(blobs, model.config.vision_config), model.config.image_token_id)
    return out, encode_images(model, out)


@torch.inference_mode()
def reference_generate(model, ids: list[int], n: int, spans) -> list[int]:
    """Greedy tokens of the reference: the whole sequence through every layer for each token."""
    ids, out = list(ids), []
    for _ in range(n):
        out.append(int(model(torch.tensor([ids]), spans=spans).logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """docs/parity.md: float tensors within 2^-6 of the reference's scale."""
    diff, scale = (got - want).abs().max().item(), want.abs().max().item()
    mean = (got - want).abs().mean().item()
    assert diff <= 2**-6 * scale, f"max diff {diff:.3g} (mean {mean:.3g}), scale {scale:.3g}"


@pytest.fixture(scope="module")
def pipeline(model_dir):
    """The model in threads (the ViT runs in the tokenizer thread at this process's thread count)."""
    root = short_dir()
    spec = with_overrides(pipeline_for("thread", root, block_tokens=BLOCK),
                          model={"config": "micro", "checkpoint": str(model_dir), "seed": 3})
    supervisor = Supervisor(spec, root / "run").start()
    peer = supervisor.peer()
    try:
        yield supervisor, peer, spec, root
    finally:
        peer.close()
        supervisor.stop()
        shutil.rmtree(root, ignore_errors=True)


def run(peer, ids, blobs, mode="ced", **options) -> tuple[list[int], m.Finished]:
    events = list(generate(peer, ids=ids, images=blobs, max_new_tokens=NEW_TOKENS, stop_at_eos=False,
                           prefill_mode=mode, **options))
    return [e.token for e in events[:-1]], events[-1]


# --- the engine -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "exact"])
def test_core_prefill_and_decode_with_an_image_match_the_reference(model, reference, mode):
    """Chunked prefill and steps against the reference's passes over the whole sequence, both in
    shape-stable numerics: the same bits (in the official numerics a GEMM may sum a chunk's rows in
    another order; on a Xeon with AMX that flipped an index choice and moved the logits by 0.3)."""
    ex, spans, _, _ = reference
    assert len(ex.ids) == 34 and ex.starts == [18]
    core = InferenceCore(model, chunk_size=8)  # chunks cut through the span
    with stable_numerics():
        with torch.inference_mode():
            want_logits = model(torch.tensor([ex.ids]), spans=spans).logits[0, -1]
        want = reference_generate(model, ex.ids, NEW_TOKENS, spans)
        seq, logits = core.prefill(ex.ids, mode, spans=spans)
        tokens = [int(logits.argmax())]
        while len(tokens) < NEW_TOKENS:
            tokens.append(int(core.step(seq, tokens[-1:])[-1].argmax()))
    assert torch.equal(logits, want_logits)
    assert tokens == want
    with torch.inference_mode():  # the image matters: the same ids without it give other logits
        text_only = model(torch.tensor([ex.ids])).logits[0, -1]
    assert (text_only - want_logits).abs().max() > 0.1 * want_logits.abs().max()


# --- the prefix-cache chain key --------------------------------------------------------------------

def test_chain_key_covers_the_image_from_the_block_holding_its_span(model, images, prompt):
    fingerprint = Fingerprint.of(model.config, "test")
    ex_a, spans_a = expanded(model, prompt, [images["a"]])
    ex_b, spans_b = expanded(model, prompt, [images["b"]])
    assert ex_a.ids == ex_b.ids and ex_a.starts == [18]
    keys = {name: block_keys(ex.ids, fingerprint, BLOCK, span_extra(spans, BLOCK))
            for name, ex, spans in (("a", ex_a, spans_a), ("b", ex_b, spans_b))}
    again = block_keys(ex_a.ids, fingerprint, BLOCK, span_extra(expanded(model, prompt, [images["a"]])[1], BLOCK))
    text = block_keys(ex_a.ids, fingerprint, BLOCK)
    assert len(keys["a"]) == 2
    assert keys["a"][0] == keys["b"][0] == text[0]  # block 0 ends before the span: shared
    assert all(ka != kb for ka, kb in zip(keys["a"][1:], keys["b"][1:], strict=True))  # the span's block and after
    assert all(ka != kt for ka, kt in zip(keys["a"][1:], text[1:], strict=True))
    assert again == keys["a"]  # the same image: the same keys


def test_in_process_cached_prefill_hits_only_with_the_same_image(model, images, prompt, tmp_path):
    core = InferenceCore(model, chunk_size=512)
    layout = BlockLayout.of(model.config, BLOCK)
    with GlobalKVStore(tmp_path / "kv", layout) as store:
        cached = CachedPrefill(core, PrefixCachePolicy(store, SWAPool(2**26), Fingerprint.of(model.config, "t"), BLOCK))
        ex, spans = expanded(model, prompt, [images["a"]])
        assert cached.prefill(ex.ids, spans=spans).cached_tokens == 0
        assert cached.prefill(ex.ids, spans=spans).cached_tokens == 32
        _, spans_b = expanded(model, prompt, [images["b"]])
        assert cached.prefill(ex.ids, spans=spans_b).cached_tokens == 16


# --- the pipeline ------------------------------------------------------------------------------------

def test_pipeline_with_an_image_equals_the_reference_and_the_in_process_core(model, images, prompt, pipeline,
                                                                              reference, tmp_path):
    _, peer, _, _ = pipeline
    ex, spans, _, want = reference
    for mode in ("exact", "full"):
        tokens, done = run(peer, prompt, [images["a"]], mode)
        assert tokens == want, mode
        assert done.prompt_tokens == len(ex.ids)
    # ced (bounded replay, the default) equals the in-process core with the same cache, bit for bit
    core = InferenceCore(model, chunk_size=512)
    layout = BlockLayout.of(model.config, BLOCK)
    with GlobalKVStore(tmp_path / "kv", layout) as store:
        cached = CachedPrefill(core, PrefixCachePolicy(store, SWAPool(2**26), Fingerprint.of(model.config, "t"), BLOCK))
        result = cached.prefill(ex.ids, capacity=len(ex.ids) + NEW_TOKENS, spans=spans)
        seq, logits, expected = result.sequence, result.logits, []
        for _ in range(NEW_TOKENS):
            expected.append(int(logits.argmax()))
            logits = core.step(seq, expected[-1:])[-1]
    tokens, done = run(peer, prompt, [images["a"]])
    assert tokens == expected and done.cached_tokens == 0


def test_pipeline_prefix_cache_is_keyed_by_image_content(model, images, prompt, pipeline):
    _, peer, _, _ = pipeline
    ids = [7, 8, *prompt]  # a prompt of its own (other tests store theirs)
    _, done = run(peer, ids, [images["a"]])
    assert done.cached_tokens == 0
    _, done = run(peer, ids, [images["a"]])
    assert done.cached_tokens == 32  # every complete block, the span's included
    _, done = run(peer, ids, [images["b"]])
    assert done.cached_tokens == 16  # only the block before the span


def test_text_prompt_with_an_image_and_no_placeholder_puts_it_in_front(model, images, pipeline):
    _, peer, _, _ = pipeline
    tokens, done = run(peer, [5, 6, 7], [images["a"]], "exact")
    ex, spans = expanded(model, [model.config.image_token_id, 5, 6, 7], [images["a"]])
    assert done.prompt_tokens == len(ex.ids)
    assert tokens == list(reference_generate(model, ex.ids, NEW_TOKENS, spans))


# --- bad images ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("blobs", "placeholders", "text"), [
    ([b"not an image at all"], 1, "cannot be decoded"),
    ([b""], 1, "empty (0 bytes)"),
    ([b"\x89PNG\r\n\x1a\n" + b"\x00" * 30], 1, "cannot be decoded"),
    ([png_header_only(8000, 8000)], 1, "the limit is 50000000 pixels"),
    ([png(30, 30, 1)] * 17, 0, "17 images in one prompt; the limit is 16"),
    ([png(30, 30, 1)] * 2, 1, "1 image placeholder(s) but 2 image(s)"),
])
def test_bad_images_fail_alone_and_the_pipeline_keeps_serving(model, images, pipeline, blobs, placeholders, text):
    _, peer, _, _ = pipeline
    ids = [5] + [model.config.image_token_id] * placeholders + [6]
    with pytest.raises(ComponentError) as failed:
        run(peer, ids, blobs)
    assert failed.value.code == m.ErrorCode.INVALID_REQUEST and text in failed.value.text
    tokens, _ = run(peer, [5, model.config.image_token_id, 6], [images["a"]])
    assert len(tokens) == NEW_TOKENS


def test_announced_images_must_come_and_spans_must_sit_on_placeholders(model, images, pipeline):
    supervisor, peer, spec, root = pipeline
    with pytest.raises(ComponentError, match="2 images announced but 0 sent"):
        list(peer.stream(m.Generate(request_id=new_request_id(), prompt="hi", images=2)))
    encoder = Peer(endpoints(spec, root / "run")["encoder"], "encoder", timeout_s=30)
    try:
        out = m.Frames()
        rows = out.add(torch.zeros(3, model.config.text_config.hidden_size, dtype=torch.bfloat16))
        bad = m.Prefill(request_id=new_request_id(), ids=m.pack_ids([5, 6, 7, 8]), spans=[rows], span_starts=[1])
        with pytest.raises(ComponentError, match="does not lie on the prompt's image placeholders"):
            encoder.call(bad, out)
        out = m.Frames()
        wide = out.add(torch.zeros(1, 3, dtype=torch.float32))
        bad = m.Prefill(request_id=new_request_id(), ids=m.pack_ids([model.config.image_token_id]), spans=[wide],
                        span_starts=[0])
        with pytest.raises(ComponentError, match="expected bfloat16"):
            encoder.call(bad, out)
    finally:
        encoder.close()
    assert len(run(peer, [5, model.config.image_token_id], [images["a"]])[0]) == NEW_TOKENS


def test_a_model_without_a_vision_tower_refuses_images(images):
    root = short_dir()
    try:
        spec = with_overrides(pipeline_for("thread", root), name="novision")  # its own inproc endpoints
        with Supervisor(spec, root / "run") as supervisor:
            peer = supervisor.peer()
            try:
                with pytest.raises(ComponentError, match="no vision tower") as failed:
                    run(peer, [5, 6], [images["a"]])
                assert failed.value.code == m.ErrorCode.INVALID_REQUEST
                assert len(run(peer, [5, 6], [])[0]) == NEW_TOKENS
            finally:
                peer.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_image_frames_round_trip_the_wire(images):
    out = m.Frames()
    request = m.Generate(request_id=1, prompt="x", image_data=[out.add(torch.frombuffer(bytearray(images["a"]),
                                                                                        dtype=torch.uint8))])
    message, frames = m.decode(m.encode(request, out))
    assert bytes(frames[message.image_data[0].frame]) == images["a"]
    reply = m.Tokens(request_id=1, ids=b"", spans=[m.Tensor("bfloat16", [2, 4], 0, 16)], span_starts=[0])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=m.Tokens) == reply


# --- front doors -----------------------------------------------------------------------------------

def test_openai_client_image_url_round_trip(model, images, pipeline):
    import openai

    from dsv41.serving.server import HTTPServer, build_app

    supervisor, _, spec, root = pipeline
    server = HTTPServer(build_app(spec, supervisor.endpoints, root / "run"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        url = "data:image/png;base64," + base64.b64encode(images["a"]).decode()
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        reply = client.chat.completions.create(model=spec_name(client), messages=[{"role": "user", "content": content}],
                                               max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens >= 1
        span = ip.preprocess(images["a"], model.config.vision_config).plan.n_tokens
        assert reply.usage.prompt_tokens > span  # the expanded prompt: the span, not one placeholder
        for bad, code, text in (
            ({"url": "https://example.com/cat.png"}, "invalid_image_url", "image URLs are not fetched"),
            ({"url": "data:image/png;base64,AAAA"}, "invalid_image", "cannot be decoded"),
            ({"url": "data:image/png;base64,###"}, "invalid_image", "base64"),
        ):
            with pytest.raises(openai.BadRequestError) as failed:
                client.chat.completions.create(model=spec_name(client), max_tokens=2, messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": bad}]}])
            assert failed.value.status_code == 400 and failed.value.body["code"] == code
            assert text in failed.value.body["message"]
        again = client.chat.completions.create(model=spec_name(client), messages=[{"role": "user", "content": content}],
                                               max_tokens=4, temperature=0)
        assert again.choices[0].message.content == reply.choices[0].message.content
    finally:
        server.stop()


def spec_name(client) -> str:
    return client.models.list().data[0].id


def test_dsv41_run_image(model_dir, images, tmp_path):
    from click.testing import CliRunner

    from dsv41.cli.main import cli

    picture, bad = tmp_path / "a.png", tmp_path / "bad.png"
    picture.write_bytes(images["a"])
    bad.write_bytes(b"nope")
    root = short_dir()
    try:
        spec = with_overrides(pipeline_for("thread", root, block_tokens=BLOCK), name="cliimages")
        (root / "pipeline.yaml").write_bytes(msgspec.yaml.encode(spec))
        runner = CliRunner()
        args = ["run", str(root / "pipeline.yaml"), "--prompt", "hi", "--max-new-tokens", "3", "--json",
                "--model", str(model_dir), "--runtime-dir", str(root / "run")]
        result = runner.invoke(cli, [*args, "--image", str(picture)])
        assert result.exit_code == 0, result.output
        done = msgspec.json.decode(result.stdout.strip().splitlines()[-1])
        span = ip.preprocess(images["a"], vision_config().vision_config).plan.n_tokens
        assert done["generated_tokens"] == 3 and done["prompt_tokens"] > span
        result = runner.invoke(cli, [*args, "--image", str(bad)])
        assert result.exit_code != 0 and "cannot be decoded" in result.output
    finally:
        shutil.rmtree(root, ignore_errors=True)
