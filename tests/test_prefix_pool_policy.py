"""Prefix keys, the host SWA pool and the prefix-cache policy."""

import hashlib
import os
import subprocess
import sys
import time

import pytest

from dsv41.config import config_from_dict, config_to_dict, load_config
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.policy import PrefixCachePolicy
from dsv41.storage.prefix import Fingerprint, block_keys, chain_seed
from dsv41.storage.store import GlobalKVStore, StoreConfig
from dsv41.storage.swa_pool import SWAPool, SWAPoolError

MINI = Fingerprint.of(load_config("mini"), "seed-0")


def test_keys_are_a_deterministic_sha256_chain():
    tokens = list(range(1000, 1600))
    keys = block_keys(tokens, MINI, 256)
    assert len(keys) == 2  # the trailing 88 tokens are no block yet
    first = hashlib.sha256(chain_seed(MINI) + b"".join(t.to_bytes(4, "little") for t in tokens[:256])).digest()
    assert keys[0] == first
    assert block_keys(tokens[:512] + [1, 2, 3], MINI, 256) == keys  # a key depends only on its prefix
    changed = tokens.copy()
    changed[10] += 1
    assert block_keys(changed, MINI, 256)[1] != keys[1]  # ...all of it


def test_keys_are_the_same_in_every_process():
    code = ("from dsv41.config import load_config; from dsv41.storage.prefix import Fingerprint, block_keys;"
            "print(block_keys(list(range(512)), Fingerprint.of(load_config('mini'), 'seed-0'), 256)[1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert outs == {block_keys(list(range(512)), MINI, 256)[1].hex()}


def test_keys_match_their_recorded_values():
    """Golden vectors: stored prefixes are found again only while the key of a given model, config
    and token list stays the same, across versions too. A change here (the fingerprint's encoding,
    the seed's domain, the token packing) makes every store on disk unreachable: do it on purpose,
    with a store format bump, never by accident."""
    assert chain_seed(MINI).hex() == "c5957873cfdc9f8ec18d2e646b27a05d867f9888a3558ff976d641051faf754f"
    keys = block_keys(list(range(512)), MINI, 256)
    assert keys[1].hex() == "968fa29c67d3216489e3c8b976100ff6b7deecb6747014a3ae8fdd7b669db078"


def test_anything_that_changes_the_stored_bytes_changes_the_keys():
    tokens = list(range(256))
    base = block_keys(tokens, MINI, 256)
    other_weights = Fingerprint.of(load_config("mini"), "seed-1")
    bigger = config_to_dict(load_config("mini"))
    bigger["text_config"]["hidden_size"] = 512
    other_model = Fingerprint.of(config_from_dict(bigger), "seed-0")
    other_format = Fingerprint(MINI.model, MINI.weights_revision, MINI.kv_format_version + 1, MINI.layer_plan)
    for fp in (other_weights, other_model, other_format):
        assert block_keys(tokens, fp, 256) != base
    assert block_keys(tokens, MINI, 256, extra={0: [b"image-sha"]}) != base
    with pytest.raises(ValueError, match="positive even number"):
        block_keys(tokens, MINI, 7)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_swa_pool_respects_its_byte_bound_and_ttl():
    clock = Clock()
    pool = SWAPool(capacity_bytes=1000, ttl_s=60, clock=clock)
    for i in range(4):
        pool.put(bytes([i]), bytes(300))
        clock.now += 1
    assert pool.bytes_used == 900 and pool.get(bytes([0])) is None  # the oldest went to keep 1000 bytes
    assert pool.get(bytes([1])) is not None  # now the most recently used
    pool.put(b"x", bytes(300))
    assert pool.get(bytes([2])) is None and pool.get(bytes([1])) is not None
    clock.now += 61
    assert pool.get(bytes([1])) is None and len(pool) == 0 and pool.bytes_used == 0
    with pytest.raises(SWAPoolError, match="cannot fit a pool of 1000 bytes"):
        pool.put(b"big", bytes(1001))


def test_swa_pool_ages_do_not_follow_the_wall_clock(monkeypatch):
    """The pool's ages come from the monotonic clock: setting the wall clock a day ahead expires
    nothing, a day back revives nothing, and the TTL still ends a snapshot's life."""
    pool = SWAPool(capacity_bytes=1000, ttl_s=0.2)
    assert pool.clock is time.monotonic
    pool.put(b"a", bytes(10))
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 86400)
    assert pool.get(b"a") == bytes(10)
    time.sleep(0.3)
    monkeypatch.setattr(time, "time", lambda: wall() - 86400)
    assert pool.get(b"a") is None


def test_default_pool_is_a_tenth_of_host_memory():
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert SWAPool().capacity == int(total * 0.10)


@pytest.fixture
def policy(tmp_path):
    layout = BlockLayout.of(load_config("mini"), 16)
    store = GlobalKVStore(tmp_path / "store", layout, StoreConfig(capacity_bytes=2**30))
    clock = Clock()
    yield PrefixCachePolicy(store, SWAPool(capacity_bytes=2**20, ttl_s=300, clock=clock), MINI, 16), clock
    store.close()


def _serve(policy, prompt, output):
    """What the core does around one request: look up, then write what the plan names."""
    hit = policy.lookup(prompt)
    plan = policy.plan_writes(hit, len(prompt), output, prompt)
    payload = bytes(policy.store.layout.payload_bytes)
    policy.write(plan, {i: payload for i, _ in plan.new_blocks}, {pos: b"rings" for pos, _ in plan.snapshots})
    return hit, plan


def test_replay_is_requested_exactly_when_the_snapshot_is_missing(policy):
    policy, clock = policy
    prompt, output = list(range(40)), list(range(100, 110))
    hit, plan = _serve(policy, prompt, output)
    assert hit.cached_blocks == 0 and not hit.needs_encoder_replay
    assert [i for i, _ in plan.new_blocks] == [0, 1, 2] and [p for p, _ in plan.snapshots] == [32, 48]
    turn2 = prompt + output + list(range(200, 230))  # the next turn of the same conversation
    hit = policy.lookup(turn2)
    assert hit.cached_tokens == 48 and hit.swa_snapshot == b"rings" and not hit.needs_encoder_replay
    clock.now += 301  # the snapshot's TTL passes; the global KV stays
    hit = policy.lookup(turn2)
    assert hit.cached_tokens == 48 and hit.swa_snapshot is None and hit.needs_encoder_replay
    other = [7] + prompt[1:]
    assert policy.lookup(other).cached_blocks == 0
