import json

import pytest

from experiments import after_backward


def test_the_probe_times_every_piece_of_each_model_and_writes_its_report(tmp_path):
    after_backward.main(["--models", "tiny", "--steps", "9", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "after_backward.json").read_text())
    (result,) = data["results"]
    assert result["model"] == "tiny" and result["steps"] == 9
    assert set(result["us"]) == {"python_after_backward", "add_after_backward", "second_add_after_backward",
                                 "add_after_forward", "add_after_optimizer", "read_after_backward",
                                 "read_repeated", "read_in_a_loop"}
    assert all(v > 0 for v in result["us"].values())
    assert data["meta"]["command"] == "python -m experiments.after_backward --models tiny --steps 9 --out " + str(tmp_path)
    report = (tmp_path / "after_backward.md").read_text()
    assert "| read after backward | " in report and "tiny (" in report


def test_fewer_steps_than_one_turn_are_refused_naming_the_argument(tmp_path):
    with pytest.raises(SystemExit):
        after_backward.main(["--models", "tiny", "--steps", "2", "--out", str(tmp_path)])
