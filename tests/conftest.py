import os
from pathlib import Path

# Triton kernels run on the CPU through Triton's interpreter in tests (set before triton loads).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from dsv41.model.reference import random_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GOLDEN = SHARED / "reference" / "golden"


@pytest.fixture(scope="session")
def micro():
    return random_model("micro", seed=1)


@pytest.fixture
def rng() -> torch.Generator:
    """A fresh generator per test, seeded from the wall clock so inputs differ between runs."""
    import time

    seed = int(os.environ.get("DSV41_TEST_SEED", time.time_ns() % 2**31))
    print(f"rng seed {seed} (DSV41_TEST_SEED={seed} repeats it)")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def root():
    """A fresh folder with a short path (Unix socket paths are limited to 107 bytes), removed after."""
    import shutil

    from tests.helpers.pipelines import short_dir

    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A small training corpus file (the first 20,000 characters of the Shakespeare text)."""
    from tests.helpers.training import corpus_slice

    return corpus_slice(tmp_path_factory.mktemp("corpus"))


def skip_where_the_gemm_sums_blocks_otherwise(shapes: list[tuple[int, int]]) -> None:
    """Skips a test that the compiled loop of quantized products serves where this machine's GEMM
    sums a 32-wide block in another order than the loop (MKL's SSE4.2 path does): the loop's
    per-shape check (`quant._loop_keeps_bits`, K x N) then rightly hands every call to the
    operators, so there is nothing to compare. The loop's own order is checked on every machine
    against a machine-independent twin (tests/test_block_scaled_loop.py)."""
    from dsv41.model import quant

    threads = torch.get_num_threads()
    for k, n in shapes:
        if not quant._loop_keeps_bits(k, n, threads):
            pytest.skip(f"this GEMM sums a {k}x{n} product's blocks otherwise than the compiled loop: "
                        "the operators serve here")
