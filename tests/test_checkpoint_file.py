"""Checkpoint files: the digest catches any damaged byte, stale temporary files are removed, the
folder is fsynced after the rename, old files still load, and pickles that run code are refused."""
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from hybrid_trainer import checkpoint
from hybrid_trainer.checkpoint import CorruptCheckpointError, UnverifiedCheckpointWarning

TRAILER = 48


def _state():
    generator = torch.Generator().manual_seed(0)
    return {"model": {"weight": torch.randn(64, 33, generator=generator), "bias": torch.arange(33.0)},
            "step_count": 7, "name": "run", "nested": [torch.ones(3, dtype=torch.int64), 2.5]}


def _assert_same(loaded, expected):
    assert loaded.keys() == expected.keys() and loaded["step_count"] == 7 and loaded["name"] == "run"
    for key in ("weight", "bias"):
        assert torch.equal(loaded["model"][key], expected["model"][key])
    assert torch.equal(loaded["nested"][0], expected["nested"][0]) and loaded["nested"][1] == 2.5


def _flip_bit(path, offset, bit=0):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_round_trip_and_the_file_stays_a_torch_file(tmp_path):
    state = _state()
    path = checkpoint.atomic_save(state, tmp_path / "ck.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a verified file loads without any warning
        _assert_same(checkpoint.load(path), state)
    _assert_same(torch.load(path, weights_only=True), state)  # torch.load skips the trailer
    assert path.read_bytes()[-8:] == b"HYBCKPT1"


@pytest.mark.parametrize("where", ["weight data", "bias data", "zip directory", "digest", "length"])
def test_one_flipped_bit_is_refused_naming_the_file(tmp_path, where):
    state = _state()
    path = checkpoint.atomic_save(state, tmp_path / "ck.pt")
    data = path.read_bytes()
    payload = len(data) - TRAILER
    offsets = {"weight data": data.index(state["model"]["weight"].numpy().tobytes()[:64]) + 1000,
               "bias data": data.index(state["model"]["bias"].numpy().tobytes()[:64]) + 17,
               "zip directory": payload - 30, "digest": payload + 5, "length": payload + 32}
    _flip_bit(path, offsets[where], bit=6)
    with pytest.raises(CorruptCheckpointError, match=r"checkpoint '.*ck\.pt' (is corrupted|is truncated or damaged)"):
        checkpoint.load(path)


def test_tensor_bit_flip_is_what_torch_itself_loads_silently(tmp_path):
    """Why the digest exists: torch does not check the zip CRC, the damaged weight just loads."""
    state = _state()
    path = checkpoint.atomic_save(state, tmp_path / "ck.pt")
    offset = path.read_bytes().index(state["model"]["weight"].numpy().tobytes()[:64]) + 3
    _flip_bit(path, offset, bit=6)  # an exponent bit of one float32
    silently = torch.load(path, weights_only=True)["model"]["weight"]
    assert not torch.equal(silently, state["model"]["weight"])
    with pytest.raises(CorruptCheckpointError, match="ck.pt"):
        checkpoint.load(path)


@pytest.mark.parametrize("keep", [0, 10, 0.5, -TRAILER - 1])
def test_truncated_file_is_refused_naming_the_file(tmp_path, keep):
    path = checkpoint.atomic_save(_state(), tmp_path / "ck.pt")
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    path.write_bytes(data[:cut])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnverifiedCheckpointWarning)  # the trailer went with the cut
        with pytest.raises(CorruptCheckpointError, match=r"checkpoint '.*ck\.pt'"):
            checkpoint.load(path)


@pytest.mark.parametrize("cut", [1, TRAILER])
def test_cut_inside_the_trailer_loads_the_intact_data_unverified(tmp_path, cut):
    """Without its last bytes the file has no trailer: like a file from before digests, its (intact)
    data loads with a warning rather than an error."""
    state = _state()
    path = checkpoint.atomic_save(state, tmp_path / "ck.pt")
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.warns(UnverifiedCheckpointWarning, match="no integrity digest"):
        _assert_same(checkpoint.load(path), state)


def test_file_without_digest_loads_with_a_warning(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "old.pt")  # what atomic_save wrote before digests existed
    with pytest.warns(UnverifiedCheckpointWarning, match=r"old\.pt.*no integrity digest"):
        _assert_same(checkpoint.load(tmp_path / "old.pt"), state)


def test_map_location_is_passed_on(tmp_path):
    path = checkpoint.atomic_save(_state(), tmp_path / "ck.pt")
    loaded = checkpoint.load(path, map_location="meta")
    assert loaded["model"]["weight"].is_meta and loaded["model"]["weight"].shape == (64, 33)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickle_that_would_run_code_is_refused(tmp_path):
    """weights_only loading, also for a file whose digest is valid (written by atomic_save)."""
    for path in (checkpoint.atomic_save({"x": _RunsCode()}, tmp_path / "evil.pt"), tmp_path / "evil_old.pt"):
        if not path.exists():
            torch.save({"x": _RunsCode()}, path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnverifiedCheckpointWarning)
            with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
                checkpoint.load(path)


# --------------------------------------------------------------------------------------------
# Temporary files and durability
# --------------------------------------------------------------------------------------------
def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_of_the_same_target_are_removed(tmp_path):
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [tmp_path / f".ck.pt.{dead}.abcd_123.tmp",  # writer gone
                 tmp_path / f".ck.pt.{os.getpid()}.zzzzzzzz.tmp",  # this pid: not writing one now
                 tmp_path / ".ck.pt.q1w2e3r4.tmp"]  # the naming before writer pids
        kept = [tmp_path / f".ck.pt.{sleeper.pid}.abcdefgh.tmp",  # its writer runs: may be in progress
                tmp_path / f".ck.pt.rank0.{dead}.abcdefgh.tmp",  # another target's
                tmp_path / ".ck.pt.abcdefgh.tmp.bak", tmp_path / "ck.pt.notes"]
        for p in stale + kept:
            p.write_bytes(b"x" * 100)
        checkpoint.atomic_save(_state(), tmp_path / "ck.pt")
        assert not any(p.exists() for p in stale)
        assert all(p.exists() for p in kept)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck.pt"] + [p.name for p in kept])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_temporary_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    """A real kill -9 in the middle of torch.save leaves its temporary file; the next save removes it."""
    target = tmp_path / "ck.pt"
    checkpoint.atomic_save({"v": torch.zeros(4)}, target)
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(checkpoint.__file__)))!r})
        import torch
        from hybrid_trainer import checkpoint
        def dies_half_way(obj, f):
            f.write(b"PK" + b"\\0" * 100000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = dies_half_way
        checkpoint.atomic_save({{"v": torch.ones(4)}}, {str(target)!r})
    """)
    child = subprocess.run([sys.executable, "-c", script], timeout=120)
    assert child.returncode == -signal.SIGKILL
    orphans = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(orphans) == 1 and orphans[0].stat().st_size > 100000
    assert torch.equal(checkpoint.load(target)["v"], torch.zeros(4))  # the previous checkpoint is intact
    checkpoint.atomic_save({"v": torch.full((4,), 2.0)}, target)
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
    assert torch.equal(checkpoint.load(target)["v"], torch.full((4,), 2.0))


def test_folder_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint.atomic_save(_state(), tmp_path / "ck.pt")
    assert events == [("fsync", "file"), ("replace", "ck.pt"), ("fsync", "dir")]


def test_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    target = checkpoint.atomic_save({"v": torch.zeros(2)}, tmp_path / "ck.pt")

    def fails(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fails)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.atomic_save({"v": torch.ones(2)}, target)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]
    assert torch.equal(checkpoint.load(target)["v"], torch.zeros(2))
