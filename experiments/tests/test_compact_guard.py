import json

import pytest
import torch

from bench.overhead import make_workload
from experiments import compact_guard


def test_the_probe_times_every_arm_in_fresh_processes_and_writes_its_report(tmp_path):
    compact_guard.main(["--model", "tiny", "--processes", "1", "--rounds", "2", "--warmup", "3",
                        "--out", str(tmp_path)])
    data = json.loads((tmp_path / "compact_guard.json").read_text())
    (process,) = data["processes"]
    assert set(process["overhead_us"]) == set(compact_guard.ARMS[1:])
    assert process["plain_step_us"] > 0
    result = data["result"]
    assert result["model"] == "tiny" and result["processes"] == 1 and result["rounds"] == 2
    assert result["arms"]["trainer"]["interval_us"] is None  # no interval from one process
    assert result["arms"]["trainer"]["by_process_us"] == [process["overhead_us"]["trainer"]]
    assert data["meta"]["command"].startswith("python -m experiments.compact_guard --model tiny")
    assert "| compact guard | " in (tmp_path / "compact_guard.md").read_text()


def test_the_compact_guard_refuses_a_non_finite_step_and_leaves_the_weights_as_they_were():
    workload = make_workload("tiny", 4, torch.device("cpu"))
    step, model = compact_guard.compact_guard_step(workload)
    x, y = workload.batches[0]
    assert not step((x, y)).skipped
    before = [p.detach().clone() for p in model.parameters()]
    poisoned = x.clone()
    poisoned[0, 0] = float("nan")
    result = step((poisoned, y))
    assert result.skipped and "nan" in result.divergence
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not step((x, y)).skipped
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_the_pooled_figures_take_the_median_and_a_sign_test_interval_over_processes():
    processes = [dict(plain_step_us=1000.0, overhead_us={arm: float(i) for arm in compact_guard.ARMS[1:]})
                 for i in range(7)]
    pooled = compact_guard.pool(processes)
    assert pooled["arms"]["trainer"]["median_us"] == 3.0
    assert pooled["arms"]["trainer"]["interval_us"] == [0.0, 6.0]  # 7 values: the extremes (sign test)


def test_a_count_below_one_is_refused_naming_the_argument(capsys):
    with pytest.raises(SystemExit):
        compact_guard.main(["--processes", "0"])
    assert "--processes" in capsys.readouterr().err
