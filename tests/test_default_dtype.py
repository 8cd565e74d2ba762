"""dsv41 under a bf16 default dtype: the official generate.py calls torch.set_default_dtype(bf16)
before building its model, so a process may import dsv41 that way. Every table and result must be
the one the fp32 default gives, bit for bit. The bf16 side runs in its own process so the global
default does not leak into other tests."""

import subprocess
import sys
from pathlib import Path

import torch

from .helpers.default_dtype_probe import probe

ROOT = Path(__file__).resolve().parents[1]


def test_a_bf16_default_dtype_changes_no_result(rng, tmp_path):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=rng))
    path = tmp_path / "bf16.pt"
    child = subprocess.Popen([sys.executable, "-m", "tests.helpers.default_dtype_probe", "bfloat16", str(seed),
                              str(path)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert torch.get_default_dtype() == torch.float32
    want = probe(seed)  # meanwhile the child computes the same under bf16
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr[-4000:]
    got = torch.load(path)
    assert got.keys() == want.keys()
    for name, expected in want.items():
        result = got[name]
        assert (result.dtype, result.shape) == (expected.dtype, expected.shape), name
        assert torch.equal(result.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)), name
