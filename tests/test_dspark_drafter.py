"""The DSpark drafter (SPEC.md §8) against the official drafter's recorded outputs: the golden
checkpoint's mtp.0..2 stages, teacher-forced on the official backbone run for 16 decode steps."""

from __future__ import annotations

import pytest
import torch

from dsv41.checkpoint import weight_files
from dsv41.model.cache import DecodeCache
from dsv41.model.dspark import Drafter, dspark_tensors, has_drafter, load_dspark, new_state
from dsv41.model.numerics import stable_numerics
from dsv41.parity import FLOAT_TOLERANCE, Golden

from .conftest import GOLDEN


@pytest.fixture(scope="module")
def run():
    golden = Golden(GOLDEN)
    io, model = golden.io, golden.model()
    files = weight_files(GOLDEN / "weights.safetensors")
    drafter = load_dspark(golden.config, files)
    d = Drafter(model, drafter)
    cache = DecodeCache.allocate(golden.config, 1, 64, official_decode_slots=True)
    state = new_state(golden.config)
    out = {"drafter": drafter, "files": files, "config": golden.config}
    with torch.inference_mode():
        first = model(io["prompt_ids"], cache=cache)
        d.observe(state, first.main_hidden[0])
        out["rings_prefill"] = [r.read()[0].clone() for r in state.rings]
        ids, logits, conf = [], [], []
        for s, token in enumerate(io["decode.input_ids"].tolist()):
            step = model(torch.tensor([[token]]), cache=cache)
            d.observe(state, step.main_hidden[0])
            chosen = int(io["decode.argmax"][s])
            draft = d.draft([state], [chosen])
            ids.append(torch.tensor([chosen] + draft.tokens[0].tolist()))
            logits.append(draft.logits[0])
            conf.append(draft.confidence[0])
    out.update(ids=torch.stack(ids), logits=torch.stack(logits), confidence=torch.stack(conf),
               rings_decode=[r.read()[0] for r in state.rings], io=io)
    return out


def test_draft_ids_match_the_official_drafter_at_every_step(run):
    assert torch.equal(run["ids"], run["io"]["dspark.draft_ids"])


def test_rings_are_bit_exact_after_prefill_and_after_decode(run):
    io = run["io"]
    for j in range(3):
        assert torch.equal(run["rings_prefill"][j], io[f"cache_after_prefill.mtp{j}.window_kv_cache"])
        assert torch.equal(run["rings_decode"][j], io[f"cache_after_decode.mtp{j}.window_kv_cache"])


def test_draft_logits_and_confidence_within_the_float_policy(run):
    io = run["io"]
    for got, name in ((run["logits"], "dspark.logits"), (run["confidence"], "dspark.confidence")):
        want = io[name]
        assert float((got - want).abs().max()) <= FLOAT_TOLERANCE * float(want.abs().max())
    # most steps agree to the head GEMM's blocking (1e-5 absolute, the golden README's bound)
    close = ((run["logits"] - io["dspark.logits"]).abs().flatten(1).amax(1) <= 1e-5).sum()
    assert int(close) >= 14


def test_stage_tensors_round_trip_through_their_stored_formats(run, tmp_path):
    from safetensors.torch import save_file

    tensors = dspark_tensors(run["drafter"])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert has_drafter([tmp_path / "model.safetensors"])
    again = load_dspark(run["config"], [tmp_path / "model.safetensors"])
    for (name, a), (_, b) in zip(run["drafter"].state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_missing_stage_tensor_is_named(run, tmp_path):
    from safetensors.torch import save_file

    from dsv41.checkpoint import CheckpointError

    tensors = dspark_tensors(run["drafter"])
    del tensors["mtp.1.attn.wkv.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp\.1\.attn\.wkv\.weight"):
        load_dspark(run["config"], [tmp_path / "model.safetensors"])


@pytest.mark.parametrize("packed", [False, True])
def test_drafting_a_batch_equals_drafting_each_sequence_alone(run, rng, packed):
    """`Drafter.draft` attends for every sequence in one call (their rings read at once); in
    shape-stable numerics each sequence's drafts, logits and confidence must be the bits it gets
    alone (in the default numerics the head's many-row GEMM sums in another order): histories of
    different lengths, one of them empty, one longer than the window."""
    golden = Golden(GOLDEN)
    drafter = Drafter(golden.model(), run["drafter"])
    width = drafter.stages[0].main_proj.in_features
    states = []
    with torch.inference_mode(), stable_numerics():
        for length in (0, 3, 17, drafter.window + 5):
            state = new_state(run["config"], packed)
            drafter.observe(state, torch.randn(length, width, generator=rng).bfloat16())
            states.append(state)
        tokens = torch.randint(3, run["config"].text_config.vocab_size, (len(states),), generator=rng).tolist()
        together = drafter.draft(states, tokens)
        for i, (state, token) in enumerate(zip(states, tokens, strict=True)):
            alone = drafter.draft([state], [token])
            assert torch.equal(alone.tokens[0], together.tokens[i])
            assert torch.equal(alone.logits[0], together.logits[i])
            assert torch.equal(alone.confidence[0], together.confidence[i])


def test_warm_up_leaves_the_drafter_as_it_was(run, rng):
    """`Drafter.warm_up` drafts for a throwaway sequence: a real sequence's drafts, logits and
    confidence are the bits they are without it."""
    width = Drafter(Golden(GOLDEN).model(), run["drafter"]).stages[0].main_proj.in_features
    history = torch.randn(9, width, generator=rng).bfloat16()
    token = int(torch.randint(3, run["config"].text_config.vocab_size, (), generator=rng))
    drafts = []
    for warm in (False, True):
        drafter = Drafter(Golden(GOLDEN).model(), run["drafter"])
        with torch.inference_mode():
            if warm:
                drafter.warm_up()
            state = new_state(run["config"])
            drafter.observe(state, history)
            drafts.append(drafter.draft([state], [token]))
    cold, warm = drafts
    assert torch.equal(cold.tokens, warm.tokens)
    assert torch.equal(cold.logits, warm.logits) and torch.equal(cold.confidence, warm.confidence)
