"""`python -m megatron_kcp.demo`: bad arguments stop in the parent, in one line (exit 2), before any rank
is spawned; good ones reach the spawn."""
from __future__ import annotations

import re

import pytest

from megatron_kcp import demo


@pytest.fixture
def spawned(monkeypatch):
    calls = []
    monkeypatch.setattr(demo.mp, "spawn", lambda fn, args, nprocs: calls.append((args[0], nprocs)))
    return calls


@pytest.mark.parametrize("argv,match", [
    (["--cu-seqlens", "0"], "--cu-seqlens 0: holds no sequence; give the document boundaries 0 len_0 len_0\\+len_1"),
    (["--cu-seqlens", "4", "40", "200"], "--cu-seqlens 4 40 200: cu_seqlens must start at 0 .*prepend 0"),
    (["--cu-seqlens", "0", "40", "32", "64"], "--cu-seqlens 0 40 32 64: cu_seqlens must be strictly increasing, but "
                                              r"cu_seqlens\[1\]=40 >= cu_seqlens\[2\]=32"),
    (["--cu-seqlens", "0", "40", "202"], "--cu-seqlens 0 40 202 with --cp 2 --layout zigzag: the packed sequence has "
                                         "202 tokens, not a multiple of 2\\*CP = 4"),
    (["--cp", "3"], "--cu-seqlens 0 40 200 256 with --cp 3 --layout zigzag: .*not a multiple of 2\\*CP = 6.*"
                    "or change --cu-seqlens, --cp or --layout"),
    (["--layout", "contiguous", "--cu-seqlens", "0", "41"], "41 tokens cannot be split over 2 CP ranks by the "
                                                            "contiguous layout"),
    (["--layout", "zigzag_per_doc", "--cu-seqlens", "0", "40", "202"], r"document \[40, 202\) has 162 tokens, not a "
                                                                       "multiple of 2\\*CP = 4"),
    (["--cp", "1"], "--cp must be >= 2"),
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--steps", "-3"], "--steps -3: must be >= 1"),
    (["--lr", "0"], "--lr 0.0: must be a positive number"),
    (["--lr", "-0.5"], "--lr -0.5: must be a positive number"),
    (["--lr", "inf"], "--lr inf: must be a positive number"),
])
def test_bad_arguments_stop_before_spawn(argv, match, spawned, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and spawned == []
    assert err[-1].startswith("python -m megatron_kcp.demo: error: ")       # argparse's one line, no traceback
    assert re.search(match, err[-1]), err[-1]


@pytest.mark.parametrize("argv", [
    [],
    ["--cp", "4", "--model", "kda", "--steps", "1"],
    ["--cp", "3", "--layout", "contiguous", "--cu-seqlens", "0", "40", "201"],
    ["--cp", "4", "--layout", "zigzag_per_doc", "--cu-seqlens", "0", "40", "200", "256"],
    ["--cp", "3", "--cu-seqlens", "0", "40", "252"],
])
def test_good_arguments_reach_the_spawn(argv, spawned):
    demo.main(argv)
    assert len(spawned) == 1 and spawned[0][1] == spawned[0][0].cp
