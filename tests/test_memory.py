"""Memory stays bounded over many requests: nothing per request is left behind in a pipeline, stale
prefetched Engram rows are dropped, and oneDNN's per-shape kernel caches are capped."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import tracemalloc

import pytest
import torch

from dsv41 import messages as m
from dsv41.components.encoder import EngramMailbox
from dsv41.pipelines.client import generate
from dsv41.pipelines.launch import Supervisor
from tests.helpers.pipelines import pipeline_for

pytestmark = pytest.mark.timeout(180)

# A fresh process (the caches' sizes are read at its first matmul): bf16 matmuls of 300 new
# shapes; prints how much malloc'd memory they left behind (each new shape costs ~0.6 MB of
# compiled kernels when oneDNN runs them, 1024 kept per cache by default).
NEW_SHAPES = """
import ctypes
import torch
from dsv41.components.sequences import bound_native_caches
bound_native_caches()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                "keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def used():
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd
torch.set_num_threads(1)
w = torch.randn(128, 512, dtype=torch.bfloat16)
for n in range(1, 400):
    torch.nn.functional.linear(torch.randn(n, 512, dtype=torch.bfloat16), w)
    if n == 100:
        before = used()
print(used() - before)
"""


def test_native_matmul_caches_stay_bounded():
    result = subprocess.run([sys.executable, "-c", NEW_SHAPES], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) < 24 * 2**20  # unbounded: ~175 MB on a CPU where oneDNN runs bf16 matmuls


def rows_message(request_id: int, start: int, n: int) -> tuple[m.EngramRows, list[memoryview]]:
    out = m.Frames()
    rows = out.add(torch.zeros(2, n, 1, 4, dtype=torch.bfloat16))
    return m.EngramRows(request_id=request_id, start=start, rows=rows, sent_at=0.0), out.buffers


def test_mailbox_drops_rows_nobody_will_take():
    now = [100.0]
    mailbox = EngramMailbox(timeout_s=5.0, clock=lambda: now[0])
    for rid in (1, 2, 3):
        mailbox.put(*rows_message(rid, 0, 8))
    for _ in range(50):  # a request's takes keep no history
        assert set(mailbox.take(1, 2, 3)) == {0, 1}
    assert mailbox.last_lead_s == 0.0
    now[0] += 30.0
    mailbox.put(*rows_message(3, 8, 1))  # 3's newest rows are fresh
    live = {1}.__contains__  # 1 has a sequence; 2 and 3 have none (failed, released, never prefilled)
    assert mailbox.sweep(live, max_age_s=20.0) == 1 and len(mailbox) == 2
    now[0] += 0.5
    assert mailbox.sweep(live, max_age_s=0.1) == 0  # at most once a second
    now[0] += 1.0
    assert mailbox.sweep(live, max_age_s=0.1) == 1 and len(mailbox) == 1
    mailbox.drop(1)
    assert len(mailbox) == 0


def test_pipeline_keeps_nothing_per_request(root):
    """Threads in this process (micro model): after warm-up, 24 more requests of new lengths leave
    no sequence, page, Engram row or scheduled request behind, and traced Python memory does not
    grow with them."""
    pipeline = pipeline_for("thread", root)
    gen = torch.Generator().manual_seed(5)

    def send(peer, count: int) -> None:
        for _ in range(count):
            n = int(torch.randint(3, 60, (1,), generator=gen))
            ids = torch.randint(3, 300, (n,), generator=gen).tolist()
            events = list(generate(peer, ids=ids, max_new_tokens=3, stop_at_eos=False))
            assert isinstance(events[-1], m.Finished)

    with Supervisor(pipeline, root / "run") as supervisor:
        peer = supervisor.peer()
        components = {name: child.server.component for name, child in supervisor.children.items()}
        try:
            send(peer, 6)
            gc.collect()
            tracemalloc.start()
            send(peer, 12)
            gc.collect()
            middle = tracemalloc.get_traced_memory()[0]
            send(peer, 12)
            gc.collect()
            end = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
            peer.close()
        encoder, decoder = components["encoder"], components["decoder"]
        deadline = time.monotonic() + 10  # the scheduler releases a request just after its Finished
        while len(encoder.sequences) + len(decoder.sequences) and time.monotonic() < deadline:
            time.sleep(0.05)
        for component in (encoder, decoder):
            assert len(component.sequences) == 0 and component.core.pages_in_use == 0
        assert len(encoder.mailbox) == 0 and not components["dspark"].active
        assert end - middle < 64 * 1024, f"traced memory grew by {end - middle} B over 12 requests"


# A fresh process: the model components' allocator policy, then a 64 MB allocation; prints whether
# the policy applied and how many bytes malloc holds in mappings of their own.
FREED_MEMORY = """
import ctypes
import numpy as np
from dsv41.components.sequences import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                "keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
applied = keep_freed_memory()
table = np.ones(16 << 20, np.float32)
print(applied, libc.mallinfo2().hblkhd)
"""


@pytest.mark.parametrize("setting", ["keep", "system"])
def test_model_components_keep_freed_memory_in_the_heap(setting):
    """With the policy (glibc), a 64 MB table comes from malloc's heap, whose freed pages the next
    step's tables reuse, instead of a mapping of its own; `DSV41_MALLOC=system` leaves malloc as it is."""
    env = {**os.environ, "DSV41_MALLOC": setting}
    result = subprocess.run([sys.executable, "-c", FREED_MEMORY], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    applied, mapped = result.stdout.split()
    if setting == "keep":
        assert applied == "True" and int(mapped) < 64 << 20
    else:
        assert applied == "False" and int(mapped) >= 64 << 20


def test_an_unknown_allocator_setting_is_refused_by_name(monkeypatch):
    from dsv41.components.sequences import keep_freed_memory

    monkeypatch.setenv("DSV41_MALLOC", "off")
    keep_freed_memory.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"DSV41_MALLOC='off': use keep \(the default\) or system"):
            keep_freed_memory()
    finally:
        keep_freed_memory.cache_clear()
