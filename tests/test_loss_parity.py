"""scripts/loss_parity.py: runs within tolerance pass, a diverging or empty run fails."""
from __future__ import annotations

import importlib.util
import json
import pathlib

spec = importlib.util.spec_from_file_location(
    "loss_parity", pathlib.Path(__file__).resolve().parents[1] / "scripts" / "loss_parity.py")
loss_parity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loss_parity)


def _log(path, losses, first=1):
    path.write_text("".join(json.dumps({"step": first + i, "loss": v}) + "\n" for i, v in enumerate(losses)))
    return str(path)


def test_parity_passes_and_fails(tmp_path, capsys):
    ref = _log(tmp_path / "cp1.jsonl", [10.0, 8.0, 6.0, 5.0])
    near = _log(tmp_path / "cp2.jsonl", [10.0, 8.1, 6.0, 5.0])                   # 1.25e-2 at step 2
    resumed = _log(tmp_path / "resume.jsonl", [6.0, 5.0], first=3)
    assert loss_parity.main([ref, near, resumed, "--reference", ref, "--tol", "2e-2"]) == 0
    assert "cp2: steps 1-4 (4), max rel diff 1.25e-02 at step 2: PASS" in capsys.readouterr().out
    assert loss_parity.main([ref, near, "--reference", ref, "--tol", "1e-2"]) == 1
    missing = str(tmp_path / "never_started.jsonl")
    assert loss_parity.main([ref, missing, "--reference", ref]) == 1
    assert "never_started: FAIL, no step in common" in capsys.readouterr().out


def test_reads_megatron_logs(tmp_path, capsys):
    """pretrain_gpt.py has no --kcp-log: its runs are compared through Megatron's own log lines."""
    line = (" [2026-11-23 10:00:00.000000] iteration {:8d}/      20 | consumed samples:            {} | "
            "learning rate: 3.000000E-04 | global batch size:     1 | lm loss: {:.6E} | loss scale: 1.0 | "
            "grad norm: 4.123 | number of skipped iterations:   0 |\n")
    log = tmp_path / "gdn_mlm.log"
    log.write_text("[megatron_kcp] KCP active: ...\n" + "".join(line.format(i, i, 10.0 / i) for i in (1, 2, 3)))
    assert loss_parity.read(log) == {1: 10.0, 2: 5.0, 3: float("3.333333E+00")}
    assert loss_parity.main([str(log), "--reference", _log(tmp_path / "ref.jsonl", [10.0, 5.0, 10 / 3]),
                             "--tol", "1e-6"]) == 0
    assert "gdn_mlm: steps 1-3 (3)" in capsys.readouterr().out
