"""bench/gpu_session.sh, the one call a lent GPU session makes: its steps' commands parse, each
step runs under its own cap while the others still run, and what it wrote comes back in one
archive. The GPU work itself only a lent machine runs; these hold the script to what that call
needs, so that a rare session's minutes do not go to a wrong flag or a missing file."""
from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from bench.overhead import arms_to_measure

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_session.sh"


def _commands() -> list[list[str]]:
    """Each ``"$PYTHON" ...`` command of the script's steps, continuation lines joined, as argv
    after the interpreter."""
    text = re.sub(r"\\\n\s*", " ", SCRIPT.read_text())
    commands = []
    for line in text.splitlines():
        if line.lstrip().startswith("step "):
            words = shlex.split(line)
            commands.append(words[words.index("$PYTHON") + 1:])
    return commands


class _Parsed(Exception):
    pass


def test_every_module_the_session_runs_accepts_its_arguments(monkeypatch):
    commands = _commands()
    modules = [argv[1] for argv in commands]
    assert modules == ["pytest", "bench.overhead", "bench.overhead", "pytest"]
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parsed = parse(self, args, namespace)  # a wrong flag exits here (SystemExit 2)
        raise _Parsed(parsed)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    seen = []
    for argv in commands[1:3]:
        module = importlib.import_module(argv[1])
        with pytest.raises(_Parsed) as parsed:
            module.main(argv[2:])
        assert parsed.value.args[0].device == "cuda" and parsed.value.args[0].fused_adamw
        seen.append(parsed.value.args[0])
    assert seen[0].arms == ["predict=False, cuda_graph", "predict=False"]  # the replayed step, timed
    assert arms_to_measure(seen[0].arms, torch.device("cuda")) == ["predict=False, cuda_graph"]  # and its memory
    assert seen[1].models == ["mlp-50m"] and seen[1].merge  # kept beside the two models
    # Both test runs in one process: under pytest-xdist they did not finish on the H200.
    assert all("no:xdist" in commands[i] and "-n" not in commands[i] for i in (0, 3))
    # Its caps add up to what its header says, inside a call's 600 s.
    text = SCRIPT.read_text()
    caps = dict(re.findall(r"^([A-Z]+)_CAP=\$\{\1_CAP:-(\d+)\}$", text, re.M))
    spent = sum(int(cap) * text.count(f'"${name}_CAP"') for name, cap in caps.items())  # a cap used twice counts twice
    assert len(caps) == 4 and spent == 540 and "add up to 540" in text
    # The tests it runs exist.
    test_paths = [word for i in (0, 3) for word in commands[i] if word.endswith(".py")]
    assert len(test_paths) == 8 and all((ROOT / path).is_file() for path in test_paths)


def test_without_its_data_the_session_stops_at_once_naming_the_make_target(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, DEVDATA=str(tmp_path / "missing"), OUT=str(tmp_path / "out"),
                                   GPU_SESSION_LOGS=str(tmp_path / "logs")))
    assert done.returncode == 2
    assert "make gpu-devdata" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_step_past_its_cap_is_stopped_the_others_run_and_every_log_comes_back(tmp_path):
    data = tmp_path / "devdata"
    (data / "fashion-mnist").mkdir(parents=True)
    (data / "bible").mkdir()
    (data / "commit").write_text("0123abcd\n0\n")
    # A stand-in interpreter: prints what each step would get, and hangs where the replayed step is timed.
    stub = tmp_path / "python3"
    stub.write_text("#!/usr/bin/env bash\n"
                    'echo "args: $*"\n'
                    'echo "commit: ${HYBRID_BENCH_GIT_COMMIT:-unset} dirty: ${HYBRID_BENCH_GIT_DIRTY:-unset}"\n'
                    'echo "fashion: $FASHION_MNIST_DIR"\n'
                    'case "$*" in *"--arms"*) sleep 60;; esac\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, DEVDATA=str(data), OUT=str(out), PYTHON=str(stub),
                                   GPU_SESSION_LOGS=str(tmp_path / "logs"),
                                   GRAPH_CAP="1"))
    assert done.returncode == 1, done.stdout + done.stderr  # one step failed (stopped at its cap)
    # Its logs where it was told, not in the repository's build/ (where a real session's wait to be read).
    assert (tmp_path / "logs" / "tests.log").is_file()
    assert "== overhead_cuda_graph: exit 124" in done.stdout
    assert all(f"== {name}: exit 0" in done.stdout for name in ("tests", "overhead_mlp50m", "kernels"))
    with tarfile.open(out / "gpu_session.tgz") as archive:
        logs = {Path(name).name: archive.extractfile(name).read().decode()
                for name in archive.getnames() if name.endswith(".log")}
    assert set(logs) == {"machine.log", "tests.log", "overhead_cuda_graph.log", "overhead_mlp50m.log",
                         "kernels.log"}
    assert "--fused-adamw" in logs["overhead_mlp50m.log"] and "--models mlp-50m" in logs["overhead_mlp50m.log"]
    # The benchmarks record the commit the tree was copied from; the tests read the tree itself.
    assert "commit: 0123abcd dirty: 0" in logs["overhead_mlp50m.log"]
    assert "commit: unset dirty: unset" in logs["tests.log"] and "commit: unset dirty: unset" in logs["kernels.log"]
    assert f"fashion: {data.resolve()}/fashion-mnist" in logs["overhead_cuda_graph.log"]
