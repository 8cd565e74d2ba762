"""Greedy speculative decoding equals plain greedy decoding (shape-stable numerics)."""

from __future__ import annotations

import pytest
import torch

from dsv41.engine.core import InferenceCore
from dsv41.engine.speculative import SpecStats, greedy_speculative, hold_checkpoint, plain_greedy, rewind
from dsv41.model.dspark import Drafter, build_dspark
from dsv41.model.numerics import stable_numerics
from dsv41.model.pages import PagePools
from dsv41.model.random_init import init_random
from dsv41.model.reference import random_model


def test_greedy_speculative_output_equals_plain_decoding():
    model = random_model("micro", seed=3)
    drafter = Drafter(model, init_random(build_dspark(model.config), 5))
    core = InferenceCore(model)
    gen = torch.Generator().manual_seed(11)
    with stable_numerics():
        for n_prompt, n_new, length in ((5, 12, None), (23, 9, 2), (40, 14, 1)):
            prompt = torch.randint(3, model.config.text_config.vocab_size, (n_prompt,), generator=gen).tolist()
            stats = SpecStats()
            got = greedy_speculative(core, drafter, prompt, n_new, length, stats=stats)
            assert got == plain_greedy(core, prompt, n_new)
            assert stats.verifications > 0
    assert core.pages_in_use == 0


class _KnownDrafter:
    """Drafts the known plain continuation, wrong at every `wrong`-th draft: exercises full
    acceptance, partial acceptance and rollback in the verification loop."""

    def __init__(self, truth: list[int], prompt_len: int, block: int, wrong: int, vocab: int):
        self.truth, self.prompt_len, self.block, self.wrong, self.vocab = truth, prompt_len, block, wrong, vocab
        self.calls = 0

    def observe(self, state, hidden) -> None:
        state.length += hidden.size(0)

    def draft(self, states, tokens):
        from dsv41.model.dspark import Draft

        self.calls += 1
        produced = states[0].length - self.prompt_len + 1  # tokens chosen so far
        ids = []
        for i in range(self.block):
            j = produced + i
            t = self.truth[j] if j < len(self.truth) else 3
            ids.append((t + 1) % self.vocab if (self.calls + i) % self.wrong == 0 else t)
        return Draft(torch.tensor([ids]), torch.zeros(1, self.block, self.vocab), torch.zeros(1, self.block))


def test_accepted_drafts_max_length_and_eos_inside_a_block():
    model = random_model("micro", seed=4)
    core = InferenceCore(model)
    vocab = model.config.text_config.vocab_size
    gen = torch.Generator().manual_seed(12)
    with stable_numerics():
        prompt = torch.randint(3, vocab, (17,), generator=gen).tolist()
        truth = plain_greedy(core, prompt, 18)
        for wrong, n_new, most in ((100, 18, 4), (3, 17, 2)):
            stats = SpecStats()
            drafter = _KnownDrafter(truth, len(prompt), 4, wrong, vocab)
            assert greedy_speculative(core, drafter, prompt, n_new, stats=stats) == truth[:n_new]
            assert max(stats.accepted) == most and min(stats.accepted) < most
        stop = truth[9]
        first = truth.index(stop)
        drafter = _KnownDrafter(truth, len(prompt), 4, 100, vocab)
        assert greedy_speculative(core, drafter, prompt, 18, stop_ids=(stop,)) == truth[: first + 1]
    assert core.pages_in_use == 0


def _chi2_quantile(df: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal quantile z."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_speculative_sampling_reproduces_the_target_distribution():
    """A first-order Markov target P and a different drafter Q over 4 tokens: the first three
    tokens emitted by repeated speculative rounds (blocks of 3 drafts) must follow P's joint
    distribution. Chi-square over the 64 cells at a false-alarm rate of 0.1 % (z = 3.09); the seed
    is fixed, so the test is deterministic. The same check with the drafter's Q as the target
    (a sampler that ignored the rule) fails."""
    from dsv41.engine.speculative import accept_sampled

    vocab, k, trials = 4, 3, 12000
    gen = torch.Generator().manual_seed(2024)
    target = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 1.5, dim=-1)
    drafter = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 1.5, dim=-1)
    counts = torch.zeros(vocab, vocab, vocab)
    for _ in range(trials):
        out, prev = [], 0
        while len(out) < 3:
            drafts, previous = [], prev
            for _ in range(k):
                previous = int(torch.multinomial(drafter[previous], 1, generator=gen))
                drafts.append(previous)
            path = [prev, *drafts]
            emitted = accept_sampled(target[path], drafter[path[:-1]], drafts, gen)
            out += emitted
            prev = out[-1]
        counts[out[0], out[1], out[2]] += 1
    start = target[0]
    joint = start[:, None, None] * target[:, :, None] * target[None, :, :]
    limit = _chi2_quantile(vocab**3 - 1, 3.09)

    def chi2(probs: torch.Tensor) -> float:
        expected = probs * trials
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(joint) < limit
    wrong = drafter[0][:, None, None] * drafter[:, :, None] * drafter[None, :, :]
    assert chi2(wrong) > limit


def _cache_state(seq) -> dict:
    cache = seq.cache
    out = {"length": cache.length, "pages": cache.pages_in_use(), "ids": cache.ids[:, : cache.length].clone(),
           "live": cache.live[:, : cache.length].clone(), "slot": cache.index_k_slot,
           "pages_in_use": seq.counters.pages_in_use}
    for layer, ring in cache.windows.items():
        out[f"ring{layer}"] = ring.data.clone()
    for layer, group in cache.groups.items():
        n = cache.length // (group.kv_state.size(1) if group.kv_state is not None else 1)
        out[f"main{layer}"] = group.main_kv.read(slice(0, n)).clone()
        out[f"index{layer}"] = group.index_k.read(slice(0, n)).clone()
        if group.kv_state is not None:
            out[f"kv_state{layer}"] = group.kv_state.clone()
            out[f"score_state{layer}"] = group.score_state.clone()
    return out


@pytest.mark.slow
def test_rollback_of_a_rejected_block_leaves_caches_bit_identical_to_never_drafting():
    model = random_model("micro", seed=6)
    core = InferenceCore(model)
    vocab = model.config.text_config.vocab_size
    gen = torch.Generator().manual_seed(13)
    with stable_numerics():
        for n_prompt, accepted in ((21, 0), (22, 1), (30, 2)):
            prompt = torch.randint(3, vocab, (n_prompt,), generator=gen).tolist()
            block = torch.randint(3, vocab, (5,), generator=gen).tolist()
            drafted, _ = core.prefill(prompt, mode="full")
            saved = core.checkpoint(drafted)
            core.step(drafted, block)  # the whole block verified, then all but `accepted + 1` rejected
            core.rollback(drafted, saved)
            core.step(drafted, block[: accepted + 1])
            plain, _ = core.prefill(prompt, mode="full")
            core.step(plain, block[: accepted + 1])
            want, got = _cache_state(plain), _cache_state(drafted)
            assert want.keys() == got.keys()
            for key in want:
                assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), key
            core.release(drafted)
            core.release(plain)
    assert core.pages_in_use == 0


def _assert_same_caches(got, want, label: str) -> None:
    want, got = _cache_state(want), _cache_state(got)
    assert want.keys() == got.keys()
    for key in want:
        a, b = torch.as_tensor(got[key] if got[key] is not None else -1), torch.as_tensor(
            want[key] if want[key] is not None else -1)
        assert torch.equal(a, b), f"{label}: {key} differs"


def _truncation_matches_stepping_the_accepted_tokens(model, prompt_lens, block_len, gen, page_entries):
    """For each prompt and each accepted count n (0 .. block_len-1): a step of the whole block cut
    back to its first n+1 tokens leaves every cache as a step of only those tokens does."""
    core = InferenceCore(model, pools=PagePools(page_entries=page_entries))
    vocab = model.config.text_config.vocab_size
    for n_prompt in prompt_lens:
        prompt = torch.randint(3, vocab, (n_prompt,), generator=gen).tolist()
        block = torch.randint(3, vocab, (block_len,), generator=gen).tolist()
        drafted, _ = core.prefill(prompt, mode="full")
        plain, _ = core.prefill(prompt, mode="full")
        for n in range(block_len - 1):
            saved = core.checkpoint(drafted)
            logits = core.step(drafted, block)
            core.truncate(drafted, saved, n_prompt + n + 1)
            before = core.checkpoint(plain)
            want_logits = core.step(plain, block[: n + 1])
            assert torch.equal(logits[: n + 1], want_logits)
            _assert_same_caches(drafted, plain, f"prompt {n_prompt}, {n + 1} of {block_len} kept")
            core.rollback(drafted, saved)
            core.rollback(plain, before)
        core.release(drafted)
        core.release(plain)
    assert core.pages_in_use == 0


@pytest.fixture(scope="module")
def micro():
    return random_model("micro", seed=6)


def test_truncating_a_verification_step_equals_stepping_only_the_accepted_tokens(micro):
    """micro: ratio-2 compressor groups (odd and even starts, so blocks begin mid-group and cross
    group boundaries), pages of 4 entries (blocks cross page boundaries of both groups), blocks of
    6 tokens in a window of 8 (ring slots wrap)."""
    with stable_numerics():
        _truncation_matches_stepping_the_accepted_tokens(micro, (5, 30), 6, torch.Generator().manual_seed(14), 4)


@pytest.mark.slow
def test_truncation_on_mini():
    """mini: three ratio-2 groups in the encoder, a ratio-1 group in the decoder, a 128-slot window."""
    model = random_model("mini", seed=7)
    with stable_numerics():
        _truncation_matches_stepping_the_accepted_tokens(model, (37, 126), 6, torch.Generator().manual_seed(15), 64)


def test_a_truncated_step_keeps_decoding_like_plain_decoding(micro):
    """After truncations, later steps (more verification blocks, a one-token step) go on exactly as
    on a sequence that only ever stepped the accepted tokens."""
    core = InferenceCore(micro, pools=PagePools(page_entries=4))
    vocab = micro.config.text_config.vocab_size
    gen = torch.Generator().manual_seed(16)
    with stable_numerics():
        prompt = torch.randint(3, vocab, (11,), generator=gen).tolist()
        drafted, _ = core.prefill(prompt, mode="full")
        plain, _ = core.prefill(prompt, mode="full")
        for kept in (1, 4, 2):
            block = torch.randint(3, vocab, (5,), generator=gen).tolist()
            saved = core.checkpoint(drafted)
            core.step(drafted, block)
            core.truncate(drafted, saved, drafted.cache.length - 5 + kept)
            core.step(plain, block[:kept])
        last = torch.randint(3, vocab, (1,), generator=gen).tolist()
        assert torch.equal(core.step(drafted, last), core.step(plain, last))
        _assert_same_caches(drafted, plain, "after three truncated blocks")
        core.release(drafted)
        core.release(plain)
    assert core.pages_in_use == 0


def test_truncate_refuses_lengths_outside_the_step(micro):
    core = InferenceCore(micro)
    seq, _ = core.prefill([5, 6, 7], mode="full")
    saved = core.checkpoint(seq)
    core.step(seq, [8, 9, 10])
    for bad in (2, 7):
        with pytest.raises(ValueError, match="cannot truncate"):
            core.truncate(seq, saved, bad)
    core.release(seq)


def test_rewind_cuts_inside_the_last_verification_step_and_refuses_other_positions(micro):
    """A step's `start` may be the sequence's length, a position inside its last verification step
    (the step is cut there) or that step's checkpoint; anything else is refused with the positions
    named, and the sequence is left as it was."""
    core = InferenceCore(micro)
    seq, _ = core.prefill([5, 6, 7, 8], mode="full", capacity=20)
    hold_checkpoint(seq, True)
    core.step(seq, [9, 10, 11, 12])  # positions 4..7 verified
    for bad in (3, 9, 12):
        with pytest.raises(ValueError, match=f"cannot step at position {bad}: the sequence holds 8 positions "
                                             "and a checkpoint at position 4"):
            rewind(seq, bad)
        assert seq.cache.length == 8 and seq.saved is not None
    rewind(seq, 8)  # at its length: nothing to do
    assert seq.cache.length == 8 and seq.saved is not None
    rewind(seq, 6)  # two of the four kept
    assert seq.cache.length == 6 and seq.saved is None
    with pytest.raises(ValueError, match="no checkpoint"):
        rewind(seq, 5)
    core.release(seq)
