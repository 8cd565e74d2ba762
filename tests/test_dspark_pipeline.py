"""Speculative decoding through the pipeline (inproc threads, shape-stable numerics): at temperature 0
the tokens equal plain decoding's, token for token, whatever the drafter proposes; requests stepped
together equal requests served alone; the stop token and the length limit end a request inside a
verified block; rolling a batch back leaves every cache bit-identical to never having drafted.

The model is `micro` exported with a random drafter (`mtp.*` tensors). A random drafter is mostly
rejected, which exercises the rollback on almost every step; a drafter that proposes the known
continuation (with planted errors) exercises whole accepted blocks and stops inside them."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

import pytest
import torch

from dsv41 import messages as m
from dsv41.components import dspark as dspark_component
from dsv41.components.runtime import new_request_id
from dsv41.engine.core import InferenceCore
from dsv41.engine.speculative import hold_checkpoint, rewind
from dsv41.export import export_model
from dsv41.model.dspark import Draft, build_dspark, dspark_tensors
from dsv41.model.numerics import stable_numerics
from dsv41.model.random_init import init_random
from dsv41.model.reference import random_model
from dsv41.pipelines.client import generate_together
from dsv41.pipelines.launch import Supervisor, with_overrides
from dsv41.serving.metrics import ComponentCollector
from tests.helpers.pipelines import pipeline_for, short_dir
from tests.test_dspark_speculative import _cache_state

pytestmark = pytest.mark.timeout(600)
BLOCK = 4  # micro's dspark_block_size


@pytest.fixture(scope="module")
def root():
    path = short_dir()
    model = random_model("micro", seed=3)
    export_model(model, model.config, path / "model", extra=dspark_tensors(init_random(build_dspark(model.config), 5)))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def pipeline(root, name: str, model_dir: str = "model", block_tokens: int = 4096, **dspark):
    """The inproc pipeline on the exported model. 4096-token store blocks store nothing here: a
    repeated prompt would hit the store, and its bounded replay changes the numbers."""
    spec = with_overrides(pipeline_for("thread", root / name, block_tokens=block_tokens, dspark=dspark),
                          model={"config": "micro", "seed": 3, "checkpoint": str(root / model_dir)}, name=name,
                          generation={"request_timeout_s": 120.0, "chunk_size": 32})
    with stable_numerics(), Supervisor(spec, root / f"run-{name}") as supervisor:
        yield supervisor


def run_all(supervisor: Supervisor, requests: list[dict]) -> list[tuple[list[int], m.Finished]]:
    """Send every request at once (they are stepped as one batch), then read each stream."""
    return generate_together(supervisor.peer, [
        m.Generate(request_id=new_request_id(), ids=m.pack_ids(r["ids"]), max_new_tokens=r["n"],
                   stop_at_eos=r.get("eos", False), temperature=r.get("temperature", 0.0), seed=r.get("seed", 0))
        for r in requests])


def one_by_one(supervisor: Supervisor, requests: list[dict]):
    return [run_all(supervisor, [r])[0] for r in requests]


def dspark_counters(supervisor: Supervisor) -> dict[str, int]:
    peer = supervisor.peer("dspark")
    try:
        return peer.ping().counters
    finally:
        peer.close()


def workload() -> list[dict]:
    """48 requests: prompts of 1..120 tokens, 1..11 new tokens (so the length limit falls inside
    drafted blocks), two prompts that share a stored 32-token prefix with an earlier one."""
    gen = torch.Generator().manual_seed(2025)
    out = []
    for i in range(46):
        n_prompt = int(torch.randint(1, 121, (1,), generator=gen))
        out.append({"ids": torch.randint(3, 300, (n_prompt,), generator=gen).tolist(), "n": 1 + i % 11})
    shared = out[5]["ids"][:32] if len(out[5]["ids"]) >= 32 else torch.randint(3, 300, (40,), generator=gen).tolist()
    out[5]["ids"] = shared + out[5]["ids"][32:]
    out += [{"ids": shared + [7, 8, 9], "n": 9}, {"ids": shared + [11, 12, 13, 14], "n": 10}]
    return out


def in_waves(supervisor: Supervisor, requests: list[dict]):
    return [res for i in range(0, len(requests), 16) for res in run_all(supervisor, requests[i : i + 16])]


def oracle(root, count: int):
    """Plain decoding (DSpark off) of the first `count` requests of the workload, in waves of 16."""
    requests = workload()[:count]
    with pipeline(root, f"off{count}", block_tokens=16, mode="off") as supervisor:
        want = in_waves(supervisor, requests)
        assert dspark_counters(supervisor).get("spec_drafts", 0) == 0
    return requests, want


@pytest.fixture(scope="module")
def plain(root):
    """The oracle of the first 24 requests (none of them a prefix hit)."""
    return oracle(root, 24)


@pytest.mark.slow
def test_fixed_length_speculative_decoding_equals_plain_decoding(root):
    """All 48 requests, with the prefix hits."""
    requests, want = oracle(root, 48)
    with pipeline(root, "fixed", block_tokens=16, mode="fixed", length=BLOCK) as supervisor:
        got = in_waves(supervisor, requests)
        counters = dspark_counters(supervisor)
    for (tokens, done), (expected, plain_done) in zip(got, want, strict=True):
        assert tokens == expected
        assert done.generated_tokens == len(expected) and done.reason == plain_done.reason == m.FinishReason.LENGTH
        assert done.cached_tokens == plain_done.cached_tokens
    assert sum(done.cached_tokens > 0 for _, done in got) >= 2  # the prefix hits
    assert counters["spec_drafts"] > 0 and counters["spec_rolled_back_tokens"] > 0  # drafts were verified and cut
    assert sum(d.verifications for _, d in got) == counters["spec_drafts"]
    assert sum(d.draft_tokens for _, d in got) == counters["spec_draft_tokens"]
    assert max(len(d.lengths) - 1 for _, d in got) == BLOCK


def test_auto_scheduler_equals_plain_decoding_and_alone(root, plain):
    """The auto scheduler (cost curve measured at start-up) on the first 20 requests (none of them a
    prefix hit in the oracle), all at once and one at a time."""
    requests, want = plain
    with pipeline(root, "auto", mode="auto") as supervisor:
        together = run_all(supervisor, requests[:20])
        alone = one_by_one(supervisor, requests[:6])
        counters = dspark_counters(supervisor)
    assert [t for t, _ in together] == [t for t, _ in want[:20]]
    assert [t for t, _ in alone] == [t for t, _ in want[:6]]
    assert counters["spec_enabled"] == 1 and counters.get("spec_profile_failed", 0) == 0
    assert counters["spec_cost_base_us"] + counters["spec_cost_per_token_us"] > 0


class KnownDrafter:
    """Drafts the known plain continuation of each request (looked up by position and last token),
    wrong at every `wrong`-th draft: whole blocks are accepted, some partially."""

    def __init__(self, truths: dict[tuple[int, int], list[int]], wrong: int, vocab: int, block: int = BLOCK,
                 window: int = 8):
        self.truths, self.wrong, self.vocab, self.block, self.window = truths, wrong, vocab, block, window
        self.calls = 0

    def observe(self, state, hidden) -> None:
        state.length += hidden.size(0)

    def draft(self, states, tokens, temperature=0.0, generators=None) -> Draft:
        rows = []
        for state, token in zip(states, tokens, strict=True):
            self.calls += 1
            truth = self.truths.get((state.length, token), [])
            row = [truth[i] if i < len(truth) else 5 for i in range(self.block)]
            rows.append([(t + 1) % self.vocab if (self.calls + i) % self.wrong == 0 else t for i, t in enumerate(row)])
        b = len(rows)
        return Draft(torch.tensor(rows), torch.zeros(b, self.block, self.vocab), torch.zeros(b, self.block))


def truth_table(requests: list[dict], outputs: list[list[int]]) -> dict[tuple[int, int], list[int]]:
    table = {}
    for request, tokens in zip(requests, outputs, strict=True):
        for i, token in enumerate(tokens):
            table[(len(request["ids"]) + i, token)] = tokens[i + 1 :]
    return table


def with_eos(root, eos: int) -> str:
    """A copy of the model directory whose end-of-sentence token is `eos`."""
    name = f"model-eos{eos}"
    if not (root / name).exists():
        shutil.copytree(root / "model", root / name)
        path = root / name / "config.json"
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos
        path.write_text(json.dumps(config))
    return name


def test_accepted_blocks_stop_and_length_inside_a_block_and_batched_equals_alone(root, plain, monkeypatch):
    requests, want = plain
    chosen = [i for i, r in enumerate(requests) if r["n"] >= 8][:8]
    requests = [requests[i] for i in chosen]
    outputs = [want[i][0] for i in chosen]
    # a token plain decoding emits in the middle of several outputs becomes the stop token
    middle = [t for tokens in outputs for t in tokens[2:-1]]
    eos = max(set(middle), key=middle.count)
    stops = [next((i for i, t in enumerate(tokens) if t == eos), None) for tokens in outputs]
    expected = [tokens if at is None else tokens[: at + 1] for tokens, at in zip(outputs, stops, strict=True)]
    assert sum(at is not None and at + 1 < len(tokens) for at, tokens in zip(stops, outputs, strict=True)) >= 1
    drafter = KnownDrafter(truth_table(requests, outputs), wrong=6, vocab=320)
    monkeypatch.setattr(dspark_component, "_speculation", lambda context: (drafter, "fixed", BLOCK))
    with pipeline(root, "known", model_dir=with_eos(root, eos)) as supervisor:
        eos_requests = [{**r, "eos": True} for r in requests]
        together = run_all(supervisor, eos_requests)
        alone = one_by_one(supervisor, eos_requests)
        counters = dspark_counters(supervisor)
    for (tokens, done), (tokens_alone, _), expect in zip(together, alone, expected, strict=True):
        assert tokens == tokens_alone == expect
        assert done.reason == (m.FinishReason.EOS if tokens[-1] == eos else m.FinishReason.LENGTH)
    assert counters["spec_accepted_pos_3"] > 0  # whole blocks accepted ...
    assert counters["spec_rolled_back_tokens"] > 0  # ... and partial ones cut in place
    accepted = sum(d.accepted_tokens for _, d in together)
    verifications = sum(d.verifications for _, d in together)
    assert accepted / verifications > 1.5
    # the same numbers in the Prometheus metrics (scraped from dspark's counters)
    families = {f.name: f for f in ComponentCollector(("dspark",), lambda name: counters, "micro").collect()}
    mean = families["dsv41_spec_decode_mean_acceptance_length"].samples[0].value
    drafts = counters["spec_drafts"]
    assert mean == pytest.approx((counters["spec_accepted_tokens"] + drafts) / drafts)
    positions = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    per_position = {s.labels["position"]: s.value for s in positions}
    assert per_position["0"] >= per_position["3"] == counters["spec_accepted_pos_3"]
    assert 0 < families["dsv41_spec_decode_drafter_time_share"].samples[0].value < 1


def test_a_drafter_mode_without_a_drafter_is_refused_and_auto_is_the_default_with_one(root):
    from dsv41.components.context import ComponentContext

    def context(checkpoint, **options):
        spec = with_overrides(pipeline_for("thread", root / "ctx", dspark=options),
                              model={"config": "micro", "seed": 3, "checkpoint": checkpoint})
        return ComponentContext(spec, {}, root)

    assert dspark_component._speculation(context(None))[1] == "off"
    with pytest.raises(ValueError, match="no DSpark drafter"):
        dspark_component._speculation(context(None, mode="fixed"))
    assert dspark_component._speculation(context(str(root / "model"), mode="off"))[:2] == (None, "off")
    drafter, mode, length = dspark_component._speculation(context(str(root / "model"), length=9))  # unset: auto
    assert drafter is not None and mode == "auto" and length == BLOCK  # capped at the block size


def test_run_options_and_summary():
    from dsv41.cli.pipeline import _summary, with_dspark
    from dsv41.pipelines.schema import load_pipeline

    pipeline = with_dspark(load_pipeline("inproc"), "fixed", 3)
    assert pipeline.components["dspark"].options == {"mode": "fixed", "length": 3}
    assert with_dspark(pipeline, None, None) is pipeline
    done = m.Finished(request_id=1, reason=m.FinishReason.LENGTH, prompt_tokens=5, generated_tokens=11,
                      cached_tokens=0, replayed_layer_tokens=0, encoder_layer_tokens=0, ttft_s=0.1, decode_s=2.0,
                      verifications=4, draft_tokens=12, accepted_tokens=6, accepted_by_position=[4, 2, 0],
                      lengths=[1, 0, 0, 4], drafter_s=0.5)
    line = _summary(done).splitlines()[-1]
    assert line.startswith("DSpark") and "acceptance length 2.50 over 4 verifications" in line
    assert "accepted by position 100% 50% 0%" in line and "lengths chosen 0:1 3:4" in line and "25%" in line


def test_sampling_through_the_pipeline_is_reproducible(root):
    """Temperature > 0 (the speculative-sampling rule; its distribution is tested in
    test_dspark_speculative): the same seed gives the same tokens, alone or batched."""
    gen = torch.Generator().manual_seed(8)
    requests = [{"ids": torch.randint(3, 300, (n,), generator=gen).tolist(), "n": 9, "temperature": 0.8, "seed": s}
                for n, s in ((12, 1), (30, 2), (5, 3))]
    with pipeline(root, "sampled", mode="fixed", length=3) as supervisor:
        together = run_all(supervisor, requests)
        alone = one_by_one(supervisor, requests)
    assert [t for t, _ in together] == [t for t, _ in alone]
    assert all(len(t) == 9 and d.verifications > 0 for t, d in together)


@pytest.mark.slow
def test_rolling_back_a_batch_leaves_every_cache_as_plain_decoding(rng):
    """Four sequences verify drafted blocks in one batched step (a checkpoint each); the next batched
    step starts each one where the component puts it: after its accepted drafts (the verification
    step is cut there in place), at its end (all accepted), or at the checkpoint (the whole step
    rolled back and its first token run again). Every cache then equals that of sequences that only
    ever stepped the kept tokens, then the next one."""
    model = random_model("micro", seed=6)
    core = InferenceCore(model)
    vocab = model.config.text_config.vocab_size

    def step(seqs, tokens, starts=None, verify=False):
        for i, seq in enumerate(seqs):
            rewind(seq, -1 if starts is None else starts[i])
            hold_checkpoint(seq, verify)
        begin = [seq.cache.length for seq in seqs]
        x, pre_mix = core.encode_tokens_batch(seqs, tokens)
        core.decode_streams_batch(seqs, x, pre_mix, begin, [len(t) for t in tokens])

    with stable_numerics():
        prompts = [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in (13, 6, 18, 9)]
        blocks = [torch.randint(3, vocab, (BLOCK + 1,), generator=rng).tolist() for _ in prompts]
        following = torch.randint(3, vocab, (len(prompts),), generator=rng).tolist()
        kept = [1, BLOCK + 1, 3, 0]  # tokens of each block that stay (0: the step is rolled back)
        drafted = [core.prefill(p, mode="full", capacity=40)[0] for p in prompts]
        plain = [core.prefill(p, mode="full", capacity=40)[0] for p in prompts]
        starts = [seq.cache.length for seq in drafted]
        step(drafted, blocks, verify=True)
        after = [[b[0]] if k == 0 else [t] for b, k, t in zip(blocks, kept, following, strict=True)]
        step(drafted, after, [s + k for s, k in zip(starts, kept, strict=True)])
        ran = [i for i, k in enumerate(kept) if k]
        step([plain[i] for i in ran], [blocks[i][: kept[i]] for i in ran])
        step(plain, after)
        with pytest.raises(ValueError, match="no checkpoint"):
            rewind(drafted[0], starts[0])  # a cut sequence holds no checkpoint any more
        for seq, ref in zip(drafted, plain, strict=True):
            want, got = _cache_state(ref), _cache_state(seq)
            assert want.keys() == got.keys()
            for key in want:
                assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), key
        for seq in drafted + plain:
            core.release(seq)
    assert core.pages_in_use == 0


def trained_workload(vocab: int) -> list[dict]:
    """52 requests for the trained default model: prompts of 1..300 tokens (past its 128-token
    window), 1..24 new tokens (so the length limit falls inside drafted blocks), every request
    stopping at the end-of-sentence token, and two prompts sharing a stored 32-token prefix."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(50):
        n_prompt = int(torch.randint(1, 301, (1,), generator=gen))
        out.append({"ids": torch.randint(3, vocab, (n_prompt,), generator=gen).tolist(), "n": 1 + i % 24,
                    "eos": True})
    shared = torch.randint(3, vocab, (40,), generator=gen).tolist()
    out[3]["ids"] = shared + out[3]["ids"]
    out += [{"ids": shared + [7, 8, 9], "n": 20, "eos": True}, {"ids": shared + [11, 12], "n": 23, "eos": True}]
    return out


@contextmanager
def trained_pipeline(root, name: str, **dspark):
    """The inproc pipeline on the built-in trained model `small` and its distilled drafter."""
    spec = with_overrides(pipeline_for("thread", root / name, block_tokens=16, dspark=dspark),
                          model={"checkpoint": "small"}, name=name,
                          generation={"request_timeout_s": 300.0, "chunk_size": 64})
    with stable_numerics(), Supervisor(spec, root / f"run-{name}") as supervisor:
        yield supervisor


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_trained_drafter_on_the_default_model_equals_plain_decoding(root):
    """The gate on the trained model: 52 requests of mixed lengths in waves of 16, long prompts,
    prefix hits, the length limit inside verified blocks and the stop token wherever the model
    emits it; `fixed` 5 and `auto` emit plain decoding's tokens and finish reasons."""
    from dsv41.checkpoint import load_any_config, resolve_model_dir

    vocab = load_any_config(resolve_model_dir("small") / "config.json")[0].text_config.vocab_size
    requests = trained_workload(vocab)
    with trained_pipeline(root, "small-off", mode="off") as supervisor:
        want = in_waves(supervisor, requests)
    for mode, options in (("fixed", {"length": 5}), ("auto", {})):
        with trained_pipeline(root, f"small-{mode}", mode=mode, **options) as supervisor:
            got = in_waves(supervisor, requests)
            counters = dspark_counters(supervisor)
        for (tokens, done), (expected, plain_done) in zip(got, want, strict=True):
            assert tokens == expected, mode
            assert done.reason == plain_done.reason and done.cached_tokens == plain_done.cached_tokens, mode
        assert counters["spec_drafts"] > 0, mode
        print(f"{mode}: {counters['spec_drafts']} verifications for {sum(len(t) for t, _ in got)} tokens")
    reasons = [done.reason for _, done in want]
    print(f"finished by length {reasons.count(m.FinishReason.LENGTH)}, by the stop token "
          f"{reasons.count(m.FinishReason.EOS)}")
    assert sum(done.cached_tokens > 0 for _, done in want) >= 2  # the prefix hits
    assert m.FinishReason.LENGTH in reasons
