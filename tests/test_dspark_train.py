"""`dsv41 train --dspark`: the drafter learns its frozen backbone's greedy tokens, checkpoints
resume bit for bit, the backbone never moves, the training forward is the inference draft pass,
and the exported drafter of the built-in model keeps greedy speculative decoding exact."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv41.checkpoint import load_model, open_model_dir, resolve_model_dir, weight_files
from dsv41.engine.core import InferenceCore
from dsv41.engine.speculative import SpecStats, greedy_speculative, plain_greedy
from dsv41.export import export_model
from dsv41.model.dspark import Drafter, has_drafter, load_dspark, new_state
from dsv41.model.numerics import stable_numerics
from dsv41.model.reference import random_model
from dsv41.training.data import Corpus
from dsv41.training.dspark import (
    DistillSet,
    DraftOptions,
    DraftTrainer,
    backbone_fingerprint,
    block_targets,
    greedy_continuations,
    load_checkpoint,
    served_drafter,
    write_drafter,
)
from tests.helpers.training import steps, train

ARGS = ["--dspark", "--config", "micro", "--seq-len", "32", "--prompt-len", "10", "--batch", "2",
        "--samples", "4", "--val-samples", "2", "--anchors", "6", "--lr", "1e-2", "--warmup", "2",
        "--threads", "1"]


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("full")
    return out, train(ARGS, corpus, out, "--steps", "24", "--save-every", "12", "--eval-every", "12")


def test_the_loss_falls_and_checkpoints_are_written(full_run):
    out, records = full_run
    losses = [r["loss"] for r in steps(records)]
    assert len(losses) == 24
    assert sum(losses[-6:]) / 6 < 0.7 * sum(losses[:6]) / 6, losses
    validations = [r for r in records if r["kind"] == "validation"]
    assert [v["step"] for v in validations] == [12, 24]
    assert len(validations[-1]["served_acceptance_by_position"]) == 4
    assert sorted(p.name for p in out.glob("dspark-*.pt")) == ["dspark-000012.pt", "dspark-000024.pt"]


def test_resume_continues_bit_for_bit(full_run, corpus, tmp_path):
    out, records = full_run
    shutil.copy(out / "distill.pt", tmp_path / "distill.pt")
    resumed = train(ARGS, corpus, tmp_path, "--steps", "24", "--resume", str(out / "dspark-000012.pt"))
    def timeless(rows):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]

    assert timeless(steps(resumed)) == timeless(steps(records)[12:])
    a, b = load_checkpoint(out / "dspark-000024.pt"), load_checkpoint(tmp_path / "dspark-000024.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_the_checkpoint_names_its_backbone(full_run, micro):
    state = load_checkpoint(full_run[0] / "dspark-000024.pt")
    assert state["backbone"] == backbone_fingerprint(micro[0])
    with pytest.raises(ValueError, match="another backbone"):
        trainer = DraftTrainer(random_model("micro", 1), None, Corpus(torch.zeros(1), torch.zeros(1)),
                               DraftOptions(**state["options"]), full_run[0] / "other", data=micro[1])
        trainer.load(full_run[0] / "dspark-000024.pt")


def _tiny_data(model, n: int = 3, length: int = 30) -> tuple[DistillSet, DistillSet]:
    prompts = torch.randint(3, 290, (n, 10), generator=torch.Generator().manual_seed(5))
    data = greedy_continuations(model, prompts, length)
    return data, data


@pytest.fixture(scope="module")
def micro() -> tuple:
    """The backbone seed 0 (as `--config micro` builds it) and greedy continuations of it."""
    backbone = random_model("micro", 0)
    return backbone, _tiny_data(backbone)


def test_training_leaves_the_backbone_bit_identical(micro):
    backbone, data = micro
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    opts = DraftOptions(steps=3, seq_len=30, batch=2, prompt_len=10, samples=3, val_samples=3, anchors=4)
    trainer = DraftTrainer(backbone, None, Corpus(torch.zeros(1), torch.zeros(1)), opts, Path("unused"), data=data)
    first = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for _ in range(3):
        trainer.train_step()
    assert all(torch.equal(before[k], v) for k, v in backbone.state_dict().items())
    assert any(not torch.equal(first[k], v) for k, v in trainer.model.state_dict().items())


def test_greedy_continuations_are_plain_greedy_decoding(micro):
    model = micro[0]
    prompts = torch.randint(3, 290, (3, 9), generator=torch.Generator().manual_seed(6))
    done = []
    data = greedy_continuations(model, prompts, 20, batch=2, progress=done.append)
    assert done == [2, 1]  # one report per engine batch
    core = InferenceCore(model)
    for row, prompt in zip(data.tokens, prompts, strict=True):
        seq, logits = core.prefill(prompt.tolist(), mode="full")
        out = [int(logits.argmax())]
        while len(out) < 11:
            out.append(int(core.step(seq, [out[-1]])[-1].argmax()))
        core.release(seq)
        assert row.tolist() == prompt.tolist() + out


def test_the_training_forward_is_the_inference_draft_pass(micro):
    """teacher_forced over a served drafter, given the drafts as previous tokens, against observe
    then draft at each anchor (the oracle), including a ring that has wrapped: bit-identical drafts,
    logits and confidence in shape-stable numerics (elsewhere one batched call and a different
    GEMM shape move FP8 roundings of the ring entries)."""
    backbone, (data, _) = micro
    opts = DraftOptions(steps=1, seq_len=30, batch=2, prompt_len=10, samples=3, val_samples=3, anchors=4)
    trainer = DraftTrainer(backbone, None, Corpus(torch.zeros(1), torch.zeros(1)), opts, Path("unused"),
                           data=(data, data))
    drafter = Drafter(backbone, served_drafter(trainer.model))
    anchors = torch.tensor([[0, 10], [0, 17], [1, 12], [1, 25]])
    expected = []
    with stable_numerics():
        for seq, p in anchors.tolist():
            state = new_state(backbone.config)
            drafter.observe(state, data.hidden[seq, :p])
            expected.append(drafter.draft([state], [int(data.tokens[seq, p])]))
        drafts = torch.cat([d.tokens for d in expected])
        previous = torch.cat([data.tokens[anchors[:, 0], anchors[:, 1]].unsqueeze(1), drafts[:, :-1]], dim=1)
        with torch.no_grad():
            got = drafter.teacher_forced(data.hidden, data.tokens, anchors, previous)
    logits = torch.cat([d.logits for d in expected])
    assert torch.equal(got.tokens, drafts)
    assert torch.equal(got.logits, logits), f"max diff {(got.logits - logits).abs().max():.3e}"
    assert torch.equal(got.confidence, torch.cat([d.confidence for d in expected]))


def test_block_targets_are_the_tokens_after_each_anchor():
    tokens = torch.arange(40).view(2, 20)
    targets, previous = block_targets(tokens, torch.tensor([[0, 3], [1, 10]]), 4)
    assert targets.tolist() == [[4, 5, 6, 7], [31, 32, 33, 34]]
    assert previous.tolist() == [[3, 4, 5, 6], [30, 31, 32, 33]]


def test_write_drafter_keeps_every_backbone_tensor(micro, tmp_path):
    backbone, data = micro
    model_dir, _ = export_model(backbone, backbone.config, tmp_path / "m")
    path = model_dir.path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        before = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    opts = DraftOptions(steps=1, seq_len=30, batch=2, prompt_len=10, samples=3, val_samples=3, anchors=4)
    trainer = DraftTrainer(backbone, None, Corpus(torch.zeros(1), torch.zeros(1)), opts, Path("unused"), data=data)
    trainer.train_step()
    write_drafter(trainer.model, model_dir.path)
    assert has_drafter([path])
    with safe_open(str(path), "pt") as f:
        for name, t in before.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
    loaded = load_dspark(backbone.config, [path]).state_dict()
    served = served_drafter(trainer.model).state_dict()
    assert all(torch.equal(loaded[k], served[k]) for k in served)


def test_the_builtin_drafter_predicts_the_backbones_greedy_continuations():
    """One draft pass after each prompt: a trained drafter's tokens often equal what the backbone
    then decodes greedily (a random one over 4,096 tokens almost never does)."""
    from dsv41.model.tokenizer import load_tokenizer

    model, _ = load_model("small")
    drafter = Drafter(model, load_dspark(model.config, weight_files(open_model_dir(resolve_model_dir("small")).path)))
    tokenizer = load_tokenizer("small", model.config.text_config.vocab_size)
    core = InferenceCore(model)
    hits = total = 0
    for text in ("ROMEO:\nBut soft, what light through yonder window", "    def __init__(self, name):\n        self.",
                 "First Citizen:\nWe are accounted poor citizens"):
        prompt = [0, *tokenizer.encode(text).ids]
        greedy = plain_greedy(core, prompt, drafter.block)
        with torch.inference_mode():
            seq, _ = core.new_sequence(prompt, len(prompt) + 1)
            x, pre_mix = core.encode_tokens_batch([seq], [prompt])
            _, hidden = core.decode_streams_batch([seq], x, pre_mix, [0], [len(prompt)])
            core.release(seq)
            state = new_state(model.config)
            drafter.observe(state, hidden[0])
            drafts = drafter.draft([state], [greedy[0]]).tokens[0].tolist()
        hits += sum(d == g for d, g in zip(drafts, greedy[1:], strict=False))
        total += len(greedy) - 1
    assert hits >= total // 4, (hits, total)


@pytest.mark.slow
def test_the_builtin_model_drafts_and_speculative_equals_plain_greedy():
    model_dir = open_model_dir(resolve_model_dir("small"))
    files = weight_files(model_dir.path)
    assert has_drafter(files)
    model, _ = load_model(model_dir)
    drafter = Drafter(model, load_dspark(model.config, files))
    core = InferenceCore(model)
    prompts = [[0, 612, 1095, 57, 311, 38], [0, 3050, 44, 44, 90, 1200, 7, 9, 15], list(range(100, 140))]
    accepted = []
    with stable_numerics():
        for prompt in prompts:
            stats = SpecStats()
            assert greedy_speculative(core, drafter, prompt, 12, stats=stats) == plain_greedy(core, prompt, 12)
            accepted += stats.accepted
    assert core.pages_in_use == 0
    assert sum(accepted) > 0  # a trained drafter gets drafts accepted
