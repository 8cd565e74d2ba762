"""benchmarks/cache_policy.py: trace checks, and its O(prompt) prefix trie and O(1) pool against
the plain forms they replace (a tuple per prefix, the real SWAPool) on small random traces."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks.cache_policy import (
    BLOCK_TOKENS,
    REPLAY_LAYER_TOKENS,
    V41_SNAPSHOT,
    PrefixTrie,
    SnapshotPool,
    TraceError,
    TraceRequest,
    load_trace,
    main,
    replay,
    summary,
)
from dsv41.storage.swa_pool import SWAPool


class Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def random_trace(rnd: random.Random, requests: int) -> list[TraceRequest]:
    """Conversations that grow turn by turn and share a few roots, with gaps around the TTL."""
    roots = [[rnd.randrange(5)] for _ in range(3)]
    chats, trace, at = [], [], 0.0
    for _ in range(requests):
        if not chats or rnd.random() < 0.3:
            chats.append(list(rnd.choice(roots)))
        chat = rnd.choice(chats)
        chat += [rnd.randrange(5, 40) for _ in range(rnd.randrange(0, 4))]
        at += rnd.choice([0.0, 500.0, 4000.0, 20000.0])
        length = (len(chat) - 1) * BLOCK_TOKENS + rnd.randrange(1, BLOCK_TOKENS + 1)
        trace.append(TraceRequest(at, length, list(chat)))
    return trace


def reference_replay(trace: list[TraceRequest], ttl_s: float, pool_bytes: int) -> tuple[int, int, int]:
    """Hit blocks, replays and pool peak the plain way: every prefix a tuple, the real pool."""
    now = [0.0]
    pool = SWAPool(capacity_bytes=pool_bytes, ttl_s=ttl_s, clock=lambda: now[0])
    stored: set[tuple[int, ...]] = set()
    hits = replays = peak = 0
    for n, req in enumerate(trace):
        now[0] = req.timestamp_ms / 1000
        prefixes = [tuple(req.hash_ids[: i + 1]) for i in range(len(req.hash_ids))]
        hit = 0
        while hit < len(prefixes) and prefixes[hit] in stored:
            hit += 1
        hits += hit
        if hit and pool.get(prefixes[hit - 1]) is None:
            replays += 1
        stored.update(prefixes[hit:])
        if req.input_length // BLOCK_TOKENS:
            pool.put(prefixes[req.input_length // BLOCK_TOKENS - 1], Sized(V41_SNAPSHOT))
        pool.put(("output", n), Sized(V41_SNAPSHOT))
        if n % 200 == 0 or n == len(trace) - 1:  # where the benchmark samples the pool
            peak = max(peak, pool.bytes_used)
    return hits, replays, peak


@pytest.mark.parametrize("seed", range(6))
def test_trie_names_the_same_prefixes_as_tuples(seed):
    rnd, trie, stored = random.Random(seed), PrefixTrie(), {}
    for req in random_trace(rnd, 150):
        prefixes = [tuple(req.hash_ids[: i + 1]) for i in range(len(req.hash_ids))]
        expected = 0
        while expected < len(prefixes) and prefixes[expected] in stored:
            expected += 1
        hit, nodes = trie.lookup_and_store(req.hash_ids)
        assert hit == expected
        for prefix, node in zip(prefixes, nodes, strict=True):
            assert stored.setdefault(prefix, node) == node  # one node per prefix, the same every time
        assert len(set(stored.values())) == len(stored) == len(trie)


def test_trie_holds_one_entry_per_block():
    """A prompt of n blocks costs n entries (n(n+1)/2 tuple items the plain way)."""
    trie = PrefixTrie()
    assert trie.lookup_and_store(list(range(5000)))[0] == 0
    assert len(trie) == 5000
    hit, nodes = trie.lookup_and_store([*range(4000), -1])
    assert hit == 4000 and len(trie) == 5001 and len(set(nodes)) == 4001


@pytest.mark.parametrize("seed", range(6))
def test_pool_matches_swapool(seed):
    rnd, now = random.Random(seed), [0.0]
    capacity, ttl = rnd.randrange(10, 40), rnd.choice([3.0, 10.0])
    real = SWAPool(capacity_bytes=capacity, ttl_s=ttl, clock=lambda: now[0])
    pool = SnapshotPool(capacity, ttl)
    for _ in range(600):
        now[0] += rnd.choice([0.0, 0.0, 1.0, 2.5])
        key = rnd.randrange(12)
        if rnd.random() < 0.5:
            size = rnd.randrange(1, 10)
            real.put(key, Sized(size))
            pool.put(key, size, now[0])
        else:
            assert pool.get(key, now[0]) == (real.get(key) is not None)
        c = real.counters
        assert (pool.bytes_used, len(pool)) == (real.bytes_used, len(real))
        assert (pool.hits, pool.misses, pool.expired, pool.evicted) == (c.hits, c.misses, c.expired, c.evicted)
    assert c.evicted and c.expired  # the random operations went through both ways out


def test_pool_refuses_a_clock_going_back_and_an_oversized_snapshot():
    pool = SnapshotPool(100, 5.0)
    pool.put("a", 10, 3.0)
    with pytest.raises(ValueError, match="clock went back"):
        pool.get("a", 2.0)
    with pytest.raises(ValueError, match="cannot fit"):
        pool.put("b", 101, 4.0)


@pytest.mark.parametrize("seed", range(4))
def test_replay_matches_the_plain_replay(seed):
    trace = random_trace(random.Random(seed), 500)
    ttl_s, pool_bytes = 10.0, 6 * V41_SNAPSHOT
    run = replay("t", trace, ttl_s, pool_bytes)
    hits, replays, peak = reference_replay(trace, ttl_s, pool_bytes)
    assert (run.hit_blocks, run.replays, summary(run)["pool_peak_bytes"]) == (hits, replays, peak)
    assert run.replay_layer_tokens == replays * REPLAY_LAYER_TOKENS and 0 < replays < sum(1 for _ in trace)


def write(tmp_path: Path, text: str, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def line(at=0, length=600, ids=(1, 2)) -> str:
    return json.dumps({"timestamp": at, "input_length": length, "output_length": 1, "hash_ids": list(ids)})


@pytest.mark.parametrize(("text", "name", "message"), [
    ("", "t.jsonl", "the file is empty"),
    ("\n  \n", "t.jsonl", "the file is empty"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,4808,10\n", "a.csv",
     "unknown trace format \\(an Azure LLM inference trace"),
    ("id,prompt\n1,hi\n", "x.csv", "unknown trace format; expected Mooncake JSONL"),
    ('{"timestamp": 0, "input_length": 5}\n', "t.jsonl", "t.jsonl:1: unknown trace format"),
    (line() + "\n{oops\n", "t.jsonl", "t.jsonl:2: not JSON"),
    (line(at=5) + "\n" + line(at=4) + "\n", "t.jsonl", "t.jsonl:2: timestamp 4 .* not before"),
    (line(length=600, ids=(1,)) + "\n", "t.jsonl", "1 hash_ids for 600 input tokens; expected one per 512-token "
     "block \\(2\\)"),
    (line(length=0, ids=()) + "\n", "t.jsonl", "input_length 0 must be a positive integer"),
    (line(ids=(1, "b")) + "\n", "t.jsonl", "hash_ids must be a list of integers"),
])
def test_bad_traces_are_refused_by_name(tmp_path, text, name, message):
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path, text, name))


def test_cli_reports_a_bad_trace_and_replays_good_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "r.json")])
    assert e.value.code == 2 and "missing.jsonl: no such file" in capsys.readouterr().err
    good = write(tmp_path, "\n".join([line(0, 1024, (1, 2)), line(1000, 1100, (1, 2, 3))]) + "\n")
    main([str(good), "--out", str(tmp_path / "r.json")])
    (row,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert (row["trace"], row["requests"], row["block_hit_rate"], row["oracle_hit_rate"]) == ("t", 2, 0.4, None)
    assert row["replays"] == 0  # the second turn finds the first one's prompt-end snapshot
