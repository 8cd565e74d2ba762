"""Vision: the resize planner, pixels, ViT, aligner and image spans against the official recorded
outputs (reference/golden_vision), bad inputs, and invariants on fresh random inputs."""

import base64
import io
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from dsv41.checkpoint import load_any_config
from dsv41.config import load_config
from dsv41.model import image_processor as ip
from dsv41.model.reference import random_model
from dsv41.model.trace import Trace
from dsv41.model.vision import encode_image, unshuffle
from dsv41.parity import compare

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "reference" / "golden_vision"
needs_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason="reference/golden_vision not present")


def _png(w: int, h: int, seed: int = 0, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def golden():
    from dsv41.parity_vision import VisionGolden

    g = VisionGolden(GOLDEN)
    return g, g.model()


@needs_golden
def test_planner_matches_the_official_table_including_float_hazards():
    from safetensors.torch import load_file

    from dsv41.parity_vision import planner_rows

    io_ = load_file(GOLDEN / "io.safetensors")
    config, _ = load_any_config(GOLDEN / "config.json")
    table = io_["units.plan_image_grid"]
    assert int(table[:, 11].sum()) == 40  # the hazard rows are in the table
    [row] = planner_rows(table, config.vision_config)
    assert row.exact, row


@needs_golden
def test_vision_golden_passes_the_policy_with_pixels_and_choices_exact(golden):
    """Floats within the parity policy (their last bits follow the CPU's instruction set, as in
    docs/parity.md; the merged embeddings carry the tower's); pixels, plans, span ids, types and
    starts, and every choice bit-exact."""
    from dsv41.parity_vision import run_vision_parity

    rows = run_vision_parity(GOLDEN)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    exact_names = ("argmax", "argmax_all", "candidate_mask", "compress_topk_idxs", "draft_ids", "engram_hash_ids",
                   "gate_indices", "image_starts", "indexer_topk", "input_ids", "output_ids", "pad_compressed_id",
                   "plan", "plan_image_grid", "span_types", "token_map", "token_types", "resized_content", "padded",
                   "patches")
    must = [r for r in rows if r.name.split(".")[-1] in exact_names
            or (r.group.endswith(".spans") and r.name != "embed_merged")]
    assert len(must) > 40 and [r.name for r in must if not r.exact] == []
    assert len([r for r in rows if r.group == "vision.vit"]) == 72


@needs_golden
def test_bias_vl_and_dead_engram_on_spans_are_what_make_it_match(golden):
    """Without the image mask (text bias, live Engram) the recorded routing is not reproduced."""
    g, model = golden
    images = [ip.preprocess((GOLDEN / "image_c_300x130.png").read_bytes(), g.config.vision_config)]
    expanded = ip.expand_prompt(g.io["p1.prompt_ids"].tolist(), images, g.config.image_token_id)
    spans = [encode_image(model, images[0], expanded.starts[0])]
    ids = torch.tensor([expanded.ids])
    with torch.inference_mode():
        trace, wrong = Trace(), Trace()
        model(ids, trace=trace, spans=spans)
        model(ids, trace=wrong, spans=spans, image_mask=torch.zeros_like(ids, dtype=torch.bool))
    want = g.io["p1.prefill.layer0.gate_indices"]
    assert torch.equal(trace["layer0.gate_indices"], want)
    assert not torch.equal(wrong["layer0.gate_indices"], want)
    assert torch.equal(trace["engram_hash_ids"], g.io["p1.prefill.engram_hash_ids"])


def test_unshuffle_is_unfold():
    for n_h, n_w in ((4, 7), (6, 13), (11, 3), (3, 3), (1, 1)):
        x = torch.randn(n_h * n_w, 5)
        grid = torch.nn.functional.pad(x.view(n_h, n_w, 5).permute(2, 0, 1), (0, -n_w % 3, 0, -n_h % 3))
        want = torch.nn.functional.unfold(grid.unsqueeze(0), 3, stride=3).squeeze(0).T
        assert torch.equal(unshuffle(x, n_h, n_w, 3), want)


@pytest.mark.parametrize("seed", range(4))
def test_letterbox_matches_pillow_pad_on_random_sizes(seed):
    rng = np.random.default_rng(seed)
    v = load_config("official").vision_config
    w, h = (int(n) for n in rng.integers(1, 900, 2))
    image = ip.preprocess(_png(w, h, seed), v)
    p = image.plan
    assert p.best_w % 14 == 0 and p.best_h % 14 == 0 and p.n_tokens <= v.max_image_tokens
    assert image.patches.shape == (p.n_vit_h * p.n_vit_w, 3, 14, 14) and image.patches.dtype == torch.bfloat16
    canvas = ImageOps.pad(Image.open(io.BytesIO(_png(w, h, seed))).convert("RGB"), (p.best_w, p.best_h),
                          color=(127, 127, 127))
    assert torch.equal(ip.to_patches(canvas, 14), image.patches)
    assert image.types.numel() == p.n_tokens and int((image.types == ip.IMAGE).sum()) == p.n_llm_h * p.n_llm_w


def test_images_in_other_modes_become_rgb():
    v = load_config("official").vision_config
    for mode in ("L", "RGBA", "P"):
        assert ip.preprocess(_png(40, 30, 1, mode), v).patches.shape[1] == 3


def test_a_random_vision_model_runs_spans_through_prefill_and_chunked_prefill_is_the_same():
    config = load_config("micro")
    vision = msgspec.structs.replace(config.vision_config, num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=48, max_image_tokens=16, min_pixels=3000)
    config = msgspec.structs.replace(config, vision_config=vision)
    model = random_model(config, seed=3)
    images = ip.load_images([_png(60, 40, 2), _png(20, 70, 3)], vision)
    prompt = [1, 5, config.image_token_id, 7, 8, config.image_token_id, 9]
    expanded = ip.expand_prompt(prompt, images, config.image_token_id)
    spans = [encode_image(model, im, s) for im, s in zip(images, expanded.starts, strict=True)]
    ids = torch.tensor([expanded.ids])
    with torch.inference_mode():
        out = model(ids, spans=spans)
        text_only = model(ids)
    assert out.logits.isfinite().all()
    assert not torch.equal(out.logits, text_only.logits)  # the spans did change the embeddings
    for span in spans:
        assert span.rows.shape == (span.end - span.start, config.text_config.hidden_size)
        assert torch.equal(span.rows[0], model.image_start) and torch.equal(span.rows[-1], model.image_end)
    with torch.inference_mode():  # spans split across two prefill calls land at the same positions
        from dsv41.model.cache import DecodeCache

        cache = DecodeCache.allocate(config, 1, ids.size(1) + 1)
        cut = expanded.starts[1] + 3
        model(ids[:, :cut], cache=cache, spans=spans)
        chunked = model(ids[:, cut:], cache=cache, spans=spans)
    assert torch.equal(chunked.logits[0, -1], out.logits[0, -1]) or \
        compare("x", "logits", chunked.logits[0, -1], out.logits[0, -1]).passed


def test_expand_prompt_places_spans_and_counts_placeholders():
    v = load_config("official").vision_config
    image = ip.preprocess(_png(300, 200), v)
    out = ip.expand_prompt([1, 99, 2], [image], 99)
    n = image.plan.n_tokens
    assert out.starts == [1] and out.ids == [1] + [99] * n + [2]
    assert out.types.tolist() == [ip.TEXT] + image.types.tolist() + [ip.TEXT]
    with pytest.raises(ip.ImageError, match="2 image placeholder"):
        ip.expand_prompt([99, 99], [image], 99)


def test_bad_images_give_clear_errors():
    v = load_config("official").vision_config
    with pytest.raises(ip.ImageError, match="empty"):
        ip.preprocess(b"", v)
    with pytest.raises(ip.ImageError, match="cannot be decoded: not an image format") as err:
        ip.preprocess(b"not an image at all", v)
    assert " at 0x" not in str(err.value)  # no in-memory object named to the client
    with pytest.raises(ip.ImageError, match="cannot be decoded"):
        ip.preprocess(_png(50, 50)[:60], v)  # truncated
    header = _png(8, 8)
    huge = bytearray(header)
    huge[16:24] = (100_000).to_bytes(4, "big") * 2  # the IHDR claims 100000 x 100000 (CRC now wrong too)
    with pytest.raises(ip.ImageError):
        ip.preprocess(bytes(huge), v)
    with pytest.raises(ip.ImageError, match="no area"):
        ip.plan_image(0, 10, v)
    with pytest.raises(ip.ImageError, match="limit is"):
        ip.load_images([_png(4, 4)] * (ip.MAX_IMAGES + 1), v)
    with pytest.raises(ip.ImageError, match="limit"):
        ip.preprocess(b"\x89PNG" + b"\0" * ip.MAX_IMAGE_BYTES, v)


def test_huge_declared_size_is_refused_before_decoding():
    v = load_config("official").vision_config
    big = Image.new("RGB", (8000, 7000))
    out = io.BytesIO()
    big.save(out, "PNG")
    with pytest.raises(ip.ImageError, match="pixels; the limit"):
        ip.preprocess(out.getvalue(), v)


def test_image_sources_bytes_path_data_url_and_openai_parts(tmp_path):
    v = load_config("official").vision_config
    data = _png(30, 20, 5)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert ip.image_bytes(data) == ip.image_bytes(str(path)) == ip.image_bytes(url) == data
    want = ip.preprocess(data, v).patches
    got = ip.image_from_openai_part({"type": "image_url", "image_url": {"url": url}}, v).patches
    assert torch.equal(got, want)
    with pytest.raises(ip.ImageError, match="never fetched"):
        ip.image_from_openai_part({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, v)
    with pytest.raises(ip.ImageError, match="not fetched"):
        ip.image_bytes("http://example.com/a.png")
    with pytest.raises(ip.ImageError, match="base64"):
        ip.image_from_openai_part({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, v)
    with pytest.raises(ip.ImageError, match="no image file"):
        ip.image_bytes(str(tmp_path / "missing.png"))


def test_text_model_refuses_images():
    model = random_model("micro")
    image = ip.preprocess(_png(30, 30), load_config("micro").vision_config)
    with pytest.raises(ip.ImageError, match="no vision tower"):
        encode_image(model, image, 0)


def test_generate_with_an_image_on_a_text_model_says_why(tmp_path):
    from click.testing import CliRunner

    from dsv41.cli.main import cli

    path = tmp_path / "a.png"
    path.write_bytes(_png(20, 20))
    result = CliRunner().invoke(cli, ["generate", "--config", "micro", "--image", str(path), "Hi"])
    assert result.exit_code != 0 and "no vision tower" in result.output
