"""The confidence-aware verification-length scheduler."""

from __future__ import annotations

import math

import pytest

from dsv41.engine.dspark_scheduler import Calibration, RoundChooser, choose_lengths, prefix_survival


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_prefix_survival_multiplies_the_sigmoids():
    got = prefix_survival([_logit(0.9), _logit(0.5), _logit(0.8)])
    assert got == pytest.approx([0.9, 0.45, 0.36])


def test_free_verification_admits_every_draft_and_costly_admits_none():
    conf = [[_logit(0.9), _logit(0.7)], [_logit(0.2), _logit(0.6)]]
    assert choose_lengths(conf, lambda n: 10.0) == [2, 2]
    assert choose_lengths(conf, lambda n: 10.0 / n**3) == [0, 0]


def test_admits_while_expected_tokens_per_second_rise():
    # step rate 1/(1 + 0.25 n): one request, survival 0.9, 0.63, 0.252
    conf = [[_logit(0.9), _logit(0.7), _logit(0.4)]]
    rate = lambda n: 1.0 / (1 + 0.25 * n)  # noqa: E731
    # theta: k=0 1/1.25=0.8; k=1 1.9/1.5=1.267; k=2 2.53/1.75=1.446; k=3 2.782/2.0=1.391 (drop)
    assert choose_lengths(conf, rate) == [2]


def test_the_more_confident_request_gets_the_longer_block():
    conf = [[_logit(0.95)] * 4, [_logit(0.3)] * 4]
    lengths = choose_lengths(conf, lambda n: 1.0 / (1 + 0.2 * n))
    assert lengths[0] > lengths[1]


def test_fixed_and_off():
    conf = [[0.0] * 5, [0.0] * 3]
    assert choose_lengths(conf, lambda n: 1.0, "fixed", 4) == [4, 3]
    assert choose_lengths(conf, lambda n: 1.0, "off") == [0, 0]
    with pytest.raises(ValueError, match="unknown DSpark schedule"):
        choose_lengths(conf, lambda n: 1.0, "sometimes")


def test_calibration_brings_an_over_confident_head_to_the_observed_rates(rng):
    """A head that says 0.99 everywhere, drafts accepted with probability 0.6 each (given the one
    before): after many verifications the calibrated predictions approach 0.6 at every position
    reached, and the auto scheduler then verifies fewer drafts than the raw head asks for."""
    import torch

    calibration, raw = Calibration(), [_logit(0.99)] * 4
    for _ in range(20000):  # position 4 is reached in ~13 % of them: ±0.06 is then ~8 standard deviations
        accepted = 0
        while accepted < 4 and float(torch.rand((), generator=rng)) < 0.6:
            accepted += 1
        calibration.observe(raw, 4, accepted)
    adjusted = [1 / (1 + math.exp(-c)) for c in calibration.adjust(raw)]
    assert adjusted == pytest.approx([0.6] * 4, abs=0.06)
    assert calibration.ratios()[0] == pytest.approx(0.6 / 0.99, abs=0.05)
    rate = lambda n: 1.0 / (1 + 0.3 * n)  # noqa: E731
    assert choose_lengths([calibration.adjust(raw)], rate) < choose_lengths([raw], rate) == [4]


def test_calibration_starts_neutral_and_counts_only_positions_reached():
    calibration = Calibration()
    raw = [_logit(0.8), _logit(0.7), _logit(0.6)]
    assert calibration.adjust(raw) == pytest.approx(raw)
    calibration.observe(raw, 3, 0)  # the first draft rejected: positions 1 and 2 were never reached
    assert len(calibration.predicted) == 1 and calibration.accepted == [0]
    assert calibration.adjust(raw)[1:] == pytest.approx(raw[1:])


@pytest.mark.parametrize("batch, spec_cost, faster, longest", [(8, 0.6, False, 32), (4, 0.5, False, 32),
                                                               (1, 0.12, True, 8), (1, 0.4, False, 8)])
def test_round_chooser_keeps_the_faster_kind_and_tries_the_other_ever_less_often(batch, spec_cost, faster,
                                                                                 longest):
    """Plain rounds emit `batch` tokens in 0.18 s (batch 8) or 0.09 s (batch 1 and 4), speculative
    ones 1.6 tokens per request in `spec_cost` s: each kind is tried once, then the faster one is
    kept and the other tried after 8, 16, 32, 32 ... rounds (at batch 1, where a try is cheap,
    every 8 rounds)."""
    chooser, picks = RoundChooser(), []
    plain_cost = 0.18 if batch == 8 else 0.09
    for _ in range(300):
        spec = chooser.speculate(batch)
        picks.append(spec)
        chooser.observe(batch, spec, round(1.6 * batch) if spec else batch, spec_cost if spec else plain_cost)
    assert picks[:2] == [True, False]
    assert (chooser.rate(batch, True) > chooser.rate(batch, False)) == faster
    others = sum(p != faster for p in picks[2:])
    expected = 300 // longest  # about one try per `longest` rounds once the wait is at its cap
    assert expected - 3 <= others <= expected + 3, others
    assert chooser.wait[batch] == longest


def test_round_chooser_is_not_put_off_speculation_by_unlucky_first_blocks():
    """Batch 1, plain rounds 1 token in 0.05 s (20 tokens/s). The first two speculative rounds
    accept nothing (1 token in 0.07 s), the later ones 2 drafts (3 tokens in 0.08 s, 37.5
    tokens/s): after the first try of each kind every round but the plain tries speculates.
    Compared on the measured rates alone, the unlucky start made plain rounds win for 15 rounds."""
    def run(optimism: float) -> list[bool]:
        chooser, picks, blocks = RoundChooser(optimism=optimism), [], 0
        for _ in range(40):
            spec = chooser.speculate(1)
            picks.append(spec)
            if spec:
                blocks += 1
                chooser.observe(1, True, 1 if blocks <= 2 else 3, 0.07 if blocks <= 2 else 0.08)
            else:
                chooser.observe(1, False, 1, 0.05)
        return picks

    hopeful, rates_alone = run(1.0), run(0.0)
    assert sum(hopeful[2:17]) >= 13, hopeful  # all but the plain tries (one in 8 rounds)
    assert sum(rates_alone[2:17]) <= 2, rates_alone


@pytest.mark.parametrize("ratio, explored, settled", [(0.45, 1, 2), (0.8, 12, 25)])
def test_round_chooser_gives_up_a_weak_drafter_after_a_bounded_number_of_rounds(ratio, explored, settled):
    """Speculative rounds at `ratio` times the plain rate (batch 1): speculation goes on while
    rate * (1 + 1 / sqrt(n)) >= the plain rate, about (1 / (1 / ratio - 1))^2 rounds (16 at 0.8),
    then plain rounds win and speculation is only tried, once in 8 rounds."""
    chooser, picks = RoundChooser(), []
    for _ in range(200):
        spec = chooser.speculate(1)
        picks.append(spec)
        chooser.observe(1, spec, 2 if spec else 1, 2 * 0.05 / ratio if spec else 0.05)
    assert sum(picks[:settled]) >= explored
    assert sum(picks[settled:]) <= (200 - settled) // 8 + 1
    assert chooser.rate(1, True) < chooser.rate(1, False)
