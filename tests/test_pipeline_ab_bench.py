"""`benchmarks/pipeline_ab.py` refuses what it cannot compare before it starts any pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.pipeline_ab import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["{missing}", "{root}"], "is not a dsv41 checkout"),
    (["{root}", "{plain}"], "is not a dsv41 checkout"),
    (["{root}", "{root}", "--rounds", "0"], "--rounds must be at least 1"),
    (["{root}", "{root}", "--tokens", "1"], "--tokens must be at least 2"),
    (["{root}", "{root}", "--prompt", "0"], "--prompt must be at least 1"),
])
def test_bad_arguments_are_refused_with_the_reason(tmp_path, capsys, argv, message):
    paths = {"missing": tmp_path / "missing", "plain": tmp_path, "root": ROOT}
    with pytest.raises(SystemExit) as info:
        main([arg.format(**paths) for arg in argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
