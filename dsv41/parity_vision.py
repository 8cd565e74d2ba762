"""Parity of the vision path with recorded official outputs (the layout of `reference/golden_vision/`:
config.json, weights.safetensors, io.safetensors, index.json, the PNG inputs; the Engram tokenizer
stub comes from the text golden folder next to it).

Compared, in the order that makes a first mismatch point at its cause: the resize planner on its
table of sizes, each image's plan, pixels and patches, the ViT and aligner tensor by tensor, each
prompt's span layout and merged embeddings, then the full prefill and the teacher-forced decode
steps layer by layer, under the tolerance policy of dsv41.parity.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch
from PIL import ImageOps

from dsv41 import parity
from dsv41.model import numerics
from dsv41.model.cache import DecodeCache
from dsv41.model.dspark import new_state
from dsv41.model.image_processor import (
    ImageInput,
    expand_prompt,
    letterbox_offset,
    open_image,
    plan_image,
    preprocess,
    resize_to_canvas,
)
from dsv41.model.trace import Trace
from dsv41.model.vision import encode_image, image_span
from dsv41.parity import Row, compare, note_flips, top2_gap

NOT_COMPARED = dict(parity.NOT_COMPARED)
NOT_COMPARED["gate_indices_if_text_bias"] = "debug value: the recorder's re-routing with the text bias"


def is_vision_golden(folder: str | Path) -> bool:
    index = Path(folder) / "index.json"
    return index.is_file() and "image_plans" in json.loads(index.read_text())


class VisionGolden(parity.Golden):
    def __init__(self, folder: Path):
        super().__init__(folder)
        self.index = json.loads((folder / "index.json").read_text())
        self.files = {key: folder / name for key, name in self._image_files().items()}

    def _image_files(self) -> dict[str, str]:
        """image_a -> image_a_50x30.png: the PNG inputs named in index.json."""
        names = [name for name in self.index["files"] if name.endswith(".png")]
        return {key: next(n for n in names if n.startswith(key + "_")) for key in self.index["image_plans"]}

    def token_map(self) -> list[int]:
        if (self.folder / "tokenizer_stub.json").is_file() or (self.folder / "tokenizer.json").is_file():
            return super().token_map()
        return parity.Golden(self.folder.parent / "golden").token_map()  # the text golden's stub

    def skipped(self, name: str) -> str | None:
        return next((why for key, why in NOT_COMPARED.items() if key in name), None)


@dataclass
class PromptView:
    """One prompt's recorded tensors with their 'p1.' prefix taken off, so that the text parity's
    per-layer comparisons read them as they read the text golden."""

    io: dict[str, torch.Tensor]
    skipped: object


def run_vision_parity(folder: str | Path, decode_mode: str = "official", packed: bool = False) -> list[Row]:
    golden = VisionGolden(Path(folder))
    io, v = golden.io, golden.config.vision_config
    rows = planner_rows(io["units.plan_image_grid"], v)
    token_map = golden.token_map()
    rows.append(compare("engram", "token_map", torch.tensor(token_map), io["engram.token_map"]))
    pad = golden.config.text_config.engram_pad_token_id
    rows.append(compare("engram", "pad_compressed_id", torch.tensor([token_map[pad]]), io["engram.pad_compressed_id"]))
    model = golden.model()
    images: dict[str, ImageInput] = {}
    for key, path in golden.files.items():
        image, image_rows = _image_rows(key, path.read_bytes(), golden)
        images[key] = image
        rows += image_rows
        trace = Trace()
        encode_image(model, image, 0, trace, f"{key}.")
        for name in sorted(k for k in io if k.startswith((f"{key}.vit.", f"{key}.aligner."))):
            group = "vision.vit" if ".vit." in name else "vision.aligner"
            got = trace.get(name)
            rows.append(compare(group, name, got, io[name]) if got is not None
                        else Row(group, name, False, False, float("nan"), 0, "not produced"))
    for prompt in sorted(golden.index["prompts"]):
        keys = _images_of(golden, prompt)
        rows += _prompt_rows(golden, model, prompt, keys, [images[k] for k in keys], decode_mode, packed)
    return rows


def planner_rows(table: torch.Tensor, v) -> list[Row]:
    """The official planner's table: min_pixels, max tokens, w, h -> canvas, grids, span length."""
    got = []
    for min_pixels, max_tokens, w, h, *_ in table.tolist():
        plan = plan_image(w, h, msgspec.structs.replace(v, min_pixels=min_pixels, max_image_tokens=max_tokens))
        got.append([min_pixels, max_tokens, w, h, plan.best_w, plan.best_h, plan.n_vit_h, plan.n_vit_w,
                    plan.n_llm_h, plan.n_llm_w, plan.n_tokens])
    return [compare("vision.planner", "plan_image_grid", torch.tensor(got), table[:, :11])]


def _image_rows(key: str, data: bytes, golden: VisionGolden) -> tuple[ImageInput, list[Row]]:
    io, v = golden.io, golden.config.vision_config
    image = preprocess(data, v)
    p = image.plan
    source = open_image(data)
    content = ImageOps.contain(source, (p.best_w, p.best_h))
    plan = [p.orig_w, p.orig_h, p.upscaled_w, p.upscaled_h, p.best_w_before_budget, p.best_h_before_budget,
            int(p.budget_shrink), p.best_w, p.best_h, content.width, content.height,
            letterbox_offset(p.best_w, content.width), letterbox_offset(p.best_h, content.height),
            p.n_vit_h, p.n_vit_w, p.n_llm_h, p.n_llm_w, p.n_tokens]
    canvas = resize_to_canvas(source, p, v)
    rows = [compare("vision.image", f"{key}.plan", torch.tensor(plan), io[f"{key}.plan"]),
            compare("vision.image", f"{key}.resized_content", _pixels(content), io[f"{key}.resized_content"]),
            compare("vision.image", f"{key}.padded", _pixels(canvas), io[f"{key}.padded"]),
            compare("vision.image", f"{key}.patches", image.patches, io[f"{key}.patches"]),
            compare("vision.image", f"{key}.span_types", image.types, io[f"{key}.span_types"])]
    return image, rows


def _pixels(image) -> torch.Tensor:
    return torch.from_numpy(np.array(image, dtype=np.uint8))


def _images_of(golden: VisionGolden, prompt: str) -> list[str]:
    """The image keys of a prompt in placeholder order (from the descriptions in index.json)."""
    found = []
    for key in golden.files:
        text = golden.index["io"][f"{key}.plan"]["description"]
        if f"prompt {prompt}" in text:
            order = 1 if "second image" in text else 0
            found.append((order, key))
    return [key for _, key in sorted(found)]


def _prompt_rows(golden: VisionGolden, model, prompt: str, image_keys: list[str], images: list[ImageInput],
                 decode_mode: str, packed: bool) -> list[Row]:
    io, config = golden.io, golden.config
    view = PromptView({k[len(prompt) + 1 :]: t for k, t in io.items() if k.startswith(prompt + ".")}, golden.skipped)
    expanded = expand_prompt(view.io["prompt_ids"].tolist(), images, config.image_token_id)
    group = f"{prompt}.spans"
    rows = [compare(group, "input_ids", torch.tensor(expanded.ids), view.io["input_ids"]),
            compare(group, "token_types", expanded.types, view.io["token_types"]),
            compare(group, "image_starts", torch.tensor(expanded.starts), view.io["image_starts"])]
    own = [encode_image(model, image, start) for image, start in zip(images, expanded.starts, strict=True)]
    ids = torch.tensor([expanded.ids])
    with torch.inference_mode():
        merged = model.embed_inputs(ids, own)
    rows.append(compare(group, "embed_merged", merged, view.io["prefill.embed_merged"]))
    # The text model runs on the recorded aligner output, as decode runs on the recorded tokens: the
    # tower's last bits follow this CPU's kernels (compared above), and a choice downstream of them
    # (an FP8 rounding, a Top-k) may flip where the recorded rows would not move it.
    spans = [image_span(model, image, start, io[f"{key}.aligner.out"])
             for key, image, start in zip(image_keys, images, expanded.starts, strict=True)]
    cand = config.text_config.candidate_source_layer_id
    capacity = golden.runtime.max_seq_len or (ids.size(1) + view.io["decode.input_ids"].numel() + 1)
    cache = DecodeCache.allocate(config, 1, capacity, official_decode_slots=decode_mode == "official", packed=packed)
    drafter = golden.drafter(model)
    state = new_state(config, packed) if drafter is not None else None
    trace = Trace()
    with torch.inference_mode():
        out = model(ids, trace=trace, cache=cache, spans=spans, image_mask=expanded.image_mask.unsqueeze(0))
        if drafter is not None:  # the prefill only seeds the drafter's rings
            drafter.observe(state, out.main_hidden[0])
    rows += _prefill_rows(view, model, trace, out, cand, prompt)
    steps, drafts = [], []
    with torch.inference_mode():
        for step, token in enumerate(view.io["decode.input_ids"].tolist()):
            step_trace = Trace()
            steps.append((step_trace, model(torch.tensor([[token]]), trace=step_trace, cache=cache)))
            if drafter is not None:  # teacher-forced backbone, then one draft pass per step
                drafter.observe(state, steps[-1][1].main_hidden[0])
                chosen = int(view.io["decode.argmax"][step])
                drafts.append((chosen, drafter.draft([state], [chosen])))
    decode = _decode_rows(view, steps, cand, prompt) + _dspark_rows(view, drafts, prompt)
    if decode_mode == "design":
        parity._mark_expected_divergence(decode, view.io["decode.positions"].tolist(),
                                         config.text_config.compress_ratios)
    return rows + decode


def _dspark_rows(view: PromptView, drafts: list, prompt: str) -> list[Row]:
    """Each decode step's draft pass (drafts are text: the text router bias throughout)."""
    io, group = view.io, f"{prompt}.dspark"
    if "dspark.draft_ids" not in io:
        return []
    if not drafts:
        return [Row(group, "draft_ids", False, False, float("nan"), 0, "no DSpark stages in the checkpoint")]
    ids = torch.stack([torch.tensor([chosen] + d.tokens[0].tolist()) for chosen, d in drafts])
    logits = torch.stack([d.logits[0] for _, d in drafts])
    confidence = torch.stack([d.confidence[0] for _, d in drafts])
    want = io["dspark.draft_ids"]
    rows = [note_flips(compare(group, "draft_ids", ids, want), ids[:, 1:], want[:, 1:], top2_gap(logits),
                       float(logits.abs().max()))]
    for name, mine in (("draft_logits", logits), ("confidence", confidence)):
        rows.append(parity._first_bad_step(compare(group, name, mine, io[f"dspark.{name}"]), mine,
                                           io[f"dspark.{name}"]))
    return rows


def _prefill_rows(view: PromptView, model, trace: Trace, out, cand: int, prompt: str) -> list[Row]:
    io, rows, group = view.io, [], f"{prompt}.prefill"
    for layer, name in parity._per_layer_keys(io, "prefill"):
        if view.skipped(name):
            continue
        mine, want = parity._mine(trace, layer, name), io[f"prefill.layer{layer}.{name}"]
        if mine is None:
            rows.append(Row(group, f"layer{layer}.{name}", False, False, float("nan"), 0, "not produced"))
            continue
        rows.append(parity._router_flips(compare(group, f"layer{layer}.{name}", mine, want), io,
                                         f"prefill.layer{layer}", mine))
    top = {"engram_hash_ids": trace["engram_hash_ids"], "candidate_mask": trace[f"layer{cand}.candidates"],
           "final_normed_hidden": out.hidden, "main_hidden": out.main_hidden}
    rows += [compare(group, name, value, io[f"prefill.{name}"]) for name, value in top.items()]
    rows.append(compare(group, "logits_all", out.logits, io["prefill.logits_all"]))
    with torch.inference_mode():  # the official forward returns the head applied to the last row alone
        last = numerics.linear(out.hidden[:, -1].float(), model.head.weight)
    rows.append(compare(group, "logits_last", last, io["prefill.logits_last"]))
    scale, argmax = float(out.logits.abs().max()), out.logits.argmax(-1)
    rows.append(note_flips(compare(group, "argmax_all", argmax, io["prefill.argmax_all"]), argmax[0],
                           io["prefill.argmax_all"][0], top2_gap(out.logits[0]), scale))
    rows.append(note_flips(compare(group, "output_ids", argmax[:, -1], io["prefill.output_ids"]), argmax[:, -1],
                           io["prefill.output_ids"], top2_gap(out.logits[:, -1]), scale))
    return rows


def _decode_rows(view: PromptView, steps: list, cand: int, prompt: str) -> list[Row]:
    io, rows, group = view.io, [], f"{prompt}.decode"
    for layer, name in parity._per_layer_keys(io, "decode"):
        if view.skipped(name):
            continue
        want = io[f"decode.layer{layer}.{name}"]
        pad = -torch.inf if name == "index_score" else None
        mine = parity._stack_steps([parity._mine(trace, layer, name) for trace, _ in steps], want, pad)
        row = parity._first_bad_step(compare(group, f"layer{layer}.{name}", mine, want), mine, want)
        rows.append(parity._router_flips(row, io, f"decode.layer{layer}", mine))
    model_level = {
        "engram_hash_ids": ([trace["engram_hash_ids"] for trace, _ in steps], None),
        "candidate_mask": ([trace[f"layer{cand}.candidates"] for trace, _ in steps], False),
        "final_normed_hidden": ([out.hidden for _, out in steps], None),
    }
    for name, (values, pad) in model_level.items():
        want = io[f"decode.{name}"]
        mine = parity._stack_steps(values, want, pad)
        rows.append(parity._first_bad_step(compare(group, name, mine, want), mine, want))
    logits = torch.stack([out.logits[0, -1] for _, out in steps])
    rows.append(parity._first_bad_step(compare(group, "logits", logits, io["decode.logits"]), logits,
                                       io["decode.logits"]))
    rows.append(note_flips(compare(group, "argmax", logits.argmax(-1), io["decode.argmax"]), logits.argmax(-1),
                           io["decode.argmax"], top2_gap(logits), float(logits.abs().max())))
    return rows


def not_compared(folder: str | Path) -> list[str]:
    golden = VisionGolden(Path(folder))
    return sorted({why for key in golden.io if (why := golden.skipped(key))})
