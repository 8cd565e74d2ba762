"""`dsv41 train`: the loss falls, checkpoints resume bit for bit, the indexer's KL term learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv41.checkpoint import load_model
from dsv41.config import load_config
from dsv41.export import export_model
from dsv41.model.reference import random_model
from dsv41.model.tokenizer import byte_tokenizer
from dsv41.training.export import load_trained
from dsv41.training.indexer_loss import indexer_kl
from dsv41.training.loop import new_model
from dsv41.training.master import inference_model, to_training
from tests.helpers.training import invoke, steps, train

ARGS = ["--config", "micro", "--seq-len", "32", "--batch", "2", "--steps", "20", "--lr", "1e-2",
        "--warmup", "2", "--dense-steps", "6", "--eval-batches", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("full")
    return out, train(ARGS, corpus, out, "--save-every", "10")


def test_loss_falls_and_checkpoints_are_written(full_run):
    out, records = full_run
    losses = [r["loss"] for r in steps(records)]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert [r["dense"] for r in steps(records)] == [True] * 6 + [False] * 14
    validations = [r for r in records if r["kind"] == "validation"]
    assert len(validations) == 1 and validations[0]["step"] == 20 and validations[0]["val_loss"] < losses[0]
    assert sorted(p.name for p in out.glob("ckpt-*.pt")) == ["ckpt-000010.pt", "ckpt-000020.pt"]


def test_resume_reproduces_the_run_bit_for_bit(full_run, corpus, tmp_path):
    out, records = full_run
    resumed = train(ARGS, corpus, tmp_path, "--resume", str(out / "ckpt-000010.pt"))
    expected = [(r["step"], r["loss"], r["index_kl"], r["grad_norm"]) for r in steps(records)[10:]]
    assert [(r["step"], r["loss"], r["index_kl"], r["grad_norm"]) for r in steps(resumed)] == expected
    final = torch.load(out / "ckpt-000020.pt", weights_only=False)["model"]
    again = torch.load(tmp_path / "ckpt-000020.pt", weights_only=False)["model"]
    assert all(torch.equal(final[k], again[k]) for k in final)


def test_resume_refuses_other_options(full_run, corpus, tmp_path):
    out, _ = full_run
    args = ["train", *ARGS, "--corpus", str(corpus), "--out", str(tmp_path), "--resume", str(out / "ckpt-000010.pt"),
            "--lr", "5e-3"]
    result = invoke(args)
    assert result.exit_code != 0 and "lr=0.01" in result.output


def test_indexer_kl_is_finite_and_falls_on_a_fixed_batch():
    config = load_config("micro")
    model = new_model(config, byte_tokenizer(config.text_config.vocab_size), seed=0)
    indexer = [p for name, p in model.named_parameters() if ".indexer." in name]
    optimizer = torch.optim.Adam(indexer, lr=1e-2)
    ids = torch.randint(3, 259, (2, 48), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(12):
        targets = []
        model(ids, index_targets=targets)
        kl = torch.stack([indexer_kl(*t) for t in targets]).mean()
        assert torch.isfinite(kl)
        optimizer.zero_grad()
        kl.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in indexer)
        optimizer.step()
        losses.append(kl.item())
    assert losses[-1] < 0.7 * losses[0]


def test_indexer_kl_values():
    scores = torch.tensor([[[0.0, 0.0, 5.0], [1.0, 2.0, 3.0]]])
    attention = torch.tensor([[[[0.25, 0.25, 0.0]], [[0.1, 0.2, 0.3]]]])  # one head
    mask = torch.tensor([[[True, True, False], [False, False, False]]])
    assert indexer_kl(scores, attention, mask).item() == pytest.approx(0.0, abs=1e-6)  # equal halves
    skewed = torch.tensor([[[[0.3, 0.1, 0.0]], [[0.0, 0.0, 0.0]]]])
    expected = 0.75 * torch.log(torch.tensor(1.5)) + 0.25 * torch.log(torch.tensor(0.5))
    assert indexer_kl(scores, skewed, mask).item() == pytest.approx(expected.item(), rel=1e-5)


def test_training_form_gives_back_the_served_model_exactly(tmp_path):
    """Masters made from a served model (as a model directory holds it) quantize back to the same
    values (FP4 bytes may pick another equal encoding), and inference on the result matches the
    original bit for bit: training mode leaves the inference path alone."""
    random = random_model("micro", 0)
    export_model(random, random.config, tmp_path / "m")
    served, _ = load_model(tmp_path / "m")
    ids = torch.randint(3, 259, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = served(ids).logits
    masters = {k: v.clone() for k, v in to_training(served).state_dict().items()}
    back = inference_model(served)
    assert not back.training
    with torch.no_grad():
        assert torch.equal(back(ids).logits, before)
    again = to_training(back).state_dict()
    assert masters.keys() == again.keys() and all(torch.equal(masters[k], again[k]) for k in masters)


def test_convert_writes_a_training_checkpoint_as_a_model_directory(full_run, tmp_path):
    """`dsv41 convert ckpt.pt DIR`: the directory loads as the release layout, and its model is the
    checkpoint's `inference_model` bit for bit (the quality numbers of training are the served ones)."""
    out, _ = full_run
    result = invoke(["convert", str(out / "ckpt-000020.pt"), str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    loaded, _ = load_model(tmp_path / "m")
    trained, _, _, step = load_trained(out / "ckpt-000020.pt")
    assert step == 20
    ids = torch.randint(3, 259, (1, 24), generator=torch.Generator().manual_seed(2))
    served = inference_model(trained)
    assert all(torch.equal(value, served.state_dict()[name]) for name, value in loaded.state_dict().items())
    with torch.no_grad():
        assert torch.equal(served(ids).logits, loaded.eval()(ids).logits)
    bad = tmp_path / "not-a-checkpoint.pt"
    bad.write_bytes(b"garbage")
    result = invoke(["convert", str(bad), str(tmp_path / "n")])
    assert result.exit_code == 1 and "is not a dsv41 training checkpoint" in result.output
    assert not (tmp_path / "n").exists()
