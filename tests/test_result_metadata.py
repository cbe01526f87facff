"""bench.protocol.run_metadata: every result file records the command, the git commit and whether
the tree was dirty; and every script in bench/ and experiments/ that writes a result uses it."""
import re
import subprocess
from pathlib import Path

import pytest

from bench import protocol

ROOT = Path(__file__).resolve().parent.parent


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A one-commit repository with a source file and a committed result file."""
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "docs" / "results" / "r.json").write_text("{}\n")
    (tmp_path / "experiments" / "results" / "e.json").write_text("{}\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_clean_tree_records_its_commit(repo):
    assert protocol.git_state.__wrapped__(repo) == (_git(repo, "rev-parse", "HEAD"), False)


def test_changed_or_new_source_makes_the_tree_dirty(repo):
    (repo / "code.py").write_text("x = 2\n")
    assert protocol.git_state.__wrapped__(repo)[1] is True
    _git(repo, "checkout", "--", "code.py")
    (repo / "new_module.py").write_text("y = 1\n")
    assert protocol.git_state.__wrapped__(repo)[1] is True


def test_rewritten_results_do_not_make_the_tree_dirty(repo):
    """A run that overwrites committed results (or adds new ones) still ran the committed code."""
    (repo / "docs" / "results" / "r.json").write_text('{"new": 1}\n')
    (repo / "experiments" / "results" / "e.json").write_text('{"new": 1}\n')
    (repo / "experiments" / "results" / "added.json").write_text("{}\n")
    assert protocol.git_state.__wrapped__(repo) == (_git(repo, "rev-parse", "HEAD"), False)


def test_outside_a_checkout_commit_and_dirtiness_are_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv(protocol.COPIED_FROM_ENV, raising=False)
    assert protocol.git_state.__wrapped__(tmp_path) == (None, None)


def test_a_copied_tree_records_the_commit_it_was_copied_from(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.COPIED_FROM_ENV, "ab" * 20)
    monkeypatch.setenv(protocol.COPIED_DIRTY_ENV, "0")
    assert protocol.git_state.__wrapped__(tmp_path) == ("ab" * 20, False)
    monkeypatch.setenv(protocol.COPIED_DIRTY_ENV, "1")
    assert protocol.git_state.__wrapped__(tmp_path) == ("ab" * 20, True)
    monkeypatch.delenv(protocol.COPIED_DIRTY_ENV)
    assert protocol.git_state.__wrapped__(tmp_path) == ("ab" * 20, None)


def test_the_copied_commit_wins_over_a_stale_git_beside_the_tree(repo, monkeypatch):
    """The lent machine's .git was the session's first commit; its tree a later one's."""
    (repo / "code.py").write_text("x = 2\n")  # a later commit's change reads as uncommitted there
    monkeypatch.setenv(protocol.COPIED_FROM_ENV, "ab" * 20)
    monkeypatch.setenv(protocol.COPIED_DIRTY_ENV, "0")
    assert protocol.git_state.__wrapped__(repo) == ("ab" * 20, False)


def test_run_metadata_of_this_checkout():
    meta = protocol.run_metadata("python -m bench.e2e --quick", device="cpu")
    assert meta["command"] == "python -m bench.e2e --quick" and meta["device"] == "cpu"
    assert meta["git_commit"] == _git(ROOT, "rev-parse", "HEAD")
    assert isinstance(meta["git_dirty"], bool)
    assert {"date", "torch", "python"} <= set(meta) and meta["date"].endswith("+00:00")


def test_run_metadata_refuses_a_missing_command_or_a_replaced_key():
    with pytest.raises(ValueError, match="command"):
        protocol.run_metadata("  ")
    with pytest.raises(ValueError, match="git_commit"):
        protocol.run_metadata("python -m bench.e2e", git_commit="abc")


def test_every_result_writer_records_run_metadata():
    """A script that writes a JSON result file must build its metadata with run_metadata (the
    per-rank scratch file of bench.ddp's workers is not a result)."""
    writers = []
    for path in sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("experiments/*.py")]):
        text = path.read_text()
        if re.search(r"\.write_text\(json\.dumps\(", text) and path.name != "protocol.py":
            writers.append(path.name)
            assert "run_metadata(" in text, f"{path.relative_to(ROOT)} writes JSON results without run_metadata"
    assert len(writers) >= 15


def test_results_index_lists_every_result_file():
    """Each committed result file appears in its folder's index (regenerate with
    ``python -m bench.results_index``); which commit is shown depends on git history, so only the
    listing is checked here."""
    from bench import results_index

    for folder in results_index.FOLDERS:
        index = (ROOT / folder / results_index.INDEX_NAME).read_text()
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.name != results_index.INDEX_NAME:
                assert f"({path.relative_to(ROOT / folder).as_posix()})" in index, f"{path} missing from {folder} index"


def test_results_index_shows_commands_as_they_run_today():
    from bench.results_index import current_command

    moved = Path("experiments/results/nowcast_fashion.json")
    assert current_command("python -m bench.nowcast evaluate --task fashion", moved) == \
        "python -m experiments.nowcast evaluate --task fashion"
    assert current_command("python -m bench.confidence --out docs/results", Path("experiments/results/confidence.json")) == \
        "python -m experiments.confidence --out experiments/results"
    assert current_command("python -m bench.e2e --tasks digits-full", Path("experiments/results/fullbatch/e2e_digits-full.json")) == \
        "python -m bench.e2e --tasks digits-full --out experiments/results/fullbatch"
    assert current_command("python -m bench.e2e", Path("docs/results/e2e_charlm.json")) == "python -m bench.e2e"
    assert current_command(None, moved) is None


def test_results_index_reads_the_commit_a_printed_table_records(tmp_path):
    from bench import results_index

    printed = tmp_path / "table.md"
    printed.write_text("Trainer overhead over the plain AdamW loop, `python -m bench.overhead` "
                       "(2026-11-24T18:48:27+00:00, commit c7dca11294, torch 2.13.0+cpu, cpu, 1 thread(s)).\n\n| a |\n")
    assert results_index.text_header_commit(printed) == ("c7dca11294", "2026-11-24")
    plain = tmp_path / "notes.md"
    plain.write_text("A table without its run's header; commit c7dca11 is mentioned later.\n")
    assert results_index.text_header_commit(plain) == (None, None)
