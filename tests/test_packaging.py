"""Packaging says what the code needs: the trainer trains without its optional extras (plots,
NVML, TensorBoard), a feature that needs one names it, and both packages ship their types."""
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_optional_features_are_extras_not_dependencies():
    core = " ".join(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "matplotlib" not in core and "nvidia-ml-py" not in core and "tensorboard" not in core
    assert extras["plot"] == ["matplotlib>=3.7"] and extras["nvml"][0].startswith("nvidia-ml-py")
    assert extras["tensorboard"][0].startswith("tensorboard")
    assert extras["dev"] == ["hybrid-trainer[test,bench,tensorboard,capacity]"]
    assert "torch>=2.6" in PYPROJECT["project"]["dependencies"]  # torch.nn.utils.get_total_norm


def test_both_packages_ship_py_typed():
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package in ("hybrid_trainer", "hybrid_kernels"):
        assert "py.typed" in data[package] and (ROOT / package / "py.typed").is_file()


@pytest.mark.slow
def test_the_trainer_trains_without_matplotlib_or_nvml(tmp_path):
    """In a process where matplotlib and pynvml cannot be imported, the trainer imports, trains,
    saves and reports; only plotting fails, with an error naming the ``plot`` extra."""
    script = """
import sys
sys.modules["matplotlib"] = None  # import fails as if not installed
sys.modules["pynvml"] = None
import torch
from hybrid_trainer import HybridConfig, HybridTrainer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
trainer = HybridTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                        lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                        config=HybridConfig(memory_profile=True, metrics_path="metrics.jsonl"))
for _ in range(30):
    trainer.step((torch.randn(16, 4), torch.randint(0, 2, (16,))))
trainer.save("run.pt")
print(trainer.summary().splitlines()[0])
try:
    trainer.plot("run.png")
except ImportError as error:
    print("PLOT:", error)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                               "HYBRID_KERNELS_BACKEND": "eager"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run.pt").is_file() and not (tmp_path / "run.png").exists()
    assert "PLOT: " in done.stdout and "pip install 'hybrid-trainer[plot]'" in done.stdout


def test_plotting_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    from hybrid_trainer.metrics import plot_run

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"plot_run draws with matplotlib.*hybrid-trainer\[plot\]"):
        plot_run([{"step": 0, "phase": "FULL", "loss": 1.0}], tmp_path / "x.png")
