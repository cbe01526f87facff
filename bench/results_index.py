"""The index of the committed result files: which command wrote each one, and at which commit.

    python -m bench.results_index [--check]

Writes ``docs/results/README.md`` (the product's benchmarks) and ``experiments/results/README.md``
(the research probes): one row per result, its companion files (the ``.md`` table and ``.png``
plot written beside a ``.json``), the command that reproduces it and the commit it came from.

The commit is the one the file records (``git_commit`` and ``git_dirty``, written by
:func:`bench.protocol.run_metadata` since it exists); for older files it is the last commit that
added or changed the file (``git log --follow``, renames not counted), marked as such: the file was
made by the code of that commit or of an earlier one. Commands recorded before the research probes
moved from ``bench`` to ``experiments`` name their old module; the index shows the current one
(:func:`current_command`). ``--check`` writes nothing and exits 1 when an index is out of date.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {
    "docs/results": "Results of the product's benchmarks (`bench/`).",
    "experiments/results": "Results of the research probes (`experiments/`; the narrative is in "
                           "[`experiments/README.md`](../README.md)).",
}
INDEX_NAME = "README.md"
# The probes that lived in bench/ before experiments/ existed (old result files name them so).
MOVED_PROBES = ("predictors", "nowcast", "nowcaster", "jumps", "scheduled", "partial_backward", "lr_control",
                "confidence", "schedule_free", "summary")
COMPANION_SUFFIXES = (".md", ".png")


@dataclass
class Entry:
    path: Path  # relative to ROOT
    companions: list[Path]
    command: str | None
    recorded_command: str | None
    commit: str
    date: str | None


def current_command(command: str | None, path: Path) -> str | None:
    """``command`` as it reads today: a moved probe's module under ``experiments``, and its output
    folder (``--out``) the one the file now lives in when it was written elsewhere."""
    if command is None:
        return None
    command = re.sub(r"\bbench\.(" + "|".join(MOVED_PROBES) + r")\b", r"experiments.\1", command)
    command = command.replace("docs/results/", "experiments/results/") if path.parts[0] == "experiments" else command
    folder = path.parent.as_posix()
    command = re.sub(r"--out \S+", f"--out {folder}", command)
    default = "experiments/results" if "python -m experiments." in command else "docs/results"
    if "--out" not in command and folder != default and "--fork-trial" not in command:
        command += f" --out {folder}"
    return command


def recorded(data) -> tuple[str | None, str | None, str | None, bool | None]:
    """(command, date, git_commit, git_dirty) a JSON result records, at its top level or in ``meta``."""
    if not isinstance(data, dict):
        return None, None, None, None
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    get = lambda key: data.get(key, meta.get(key))  # noqa: E731
    return get("command"), get("date"), get("git_commit"), get("git_dirty")


def text_command(path: Path) -> str | None:
    """The first ``python -m ...`` command a Markdown or text result names (its header)."""
    match = re.search(r"python -m [\w.]+[^`\n(]*", path.read_text(errors="replace"))
    return match.group(0).strip() if match else None


def text_header_commit(path: Path) -> tuple[str | None, str | None]:
    """(commit, date) a Markdown or text result's first line records, as the tables
    :mod:`bench.protocol`'s callers print write it (``(<ISO date>, commit <hex>, ...``)."""
    lines = path.read_text(errors="replace").splitlines()
    match = re.search(r"\((\d{4}-\d\d-\d\d)T[^,]*, commit ([0-9a-f]{7,40})", lines[0] if lines else "")
    return (match.group(2), match.group(1)) if match else (None, None)


def last_change(path: Path) -> str:
    """The last commit that added or changed ``path`` (renames followed, not counted)."""
    out = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--follow", "--diff-filter=AM", "--format=%h %cs", "--",
                          str(path)], capture_output=True, text=True).stdout.strip()
    return f"≤ {out.split()[0]} (not recorded)" if out else "not committed"


def entries(folder: str) -> list[Entry]:
    base = ROOT / folder
    files = sorted(p.relative_to(ROOT) for p in base.rglob("*") if p.is_file() and p.name != INDEX_NAME)
    taken: set[Path] = set()
    out: list[Entry] = []
    for path in [p for p in files if p.suffix == ".json"] + [p for p in files if p.suffix != ".json"]:
        if path in taken:
            continue
        companions = [path.with_suffix(s) for s in COMPANION_SUFFIXES
                      if path.suffix == ".json" and path.with_suffix(s) in files]
        taken.update([path, *companions])
        if path.suffix == ".json":
            command, date, commit, dirty = recorded(json.loads((ROOT / path).read_text()))
        elif path.suffix in (".md", ".txt"):
            commit, date = text_header_commit(ROOT / path)
            command, dirty = text_command(ROOT / path), None
        else:
            command, date, commit, dirty = None, None, None, None
        where = (f"{commit[:10]}" + (" (uncommitted changes)" if dirty else "")) if commit else last_change(path)
        out.append(Entry(path, companions, current_command(command, path), command, where, date))
    return out


def markdown(folder: str) -> str:
    rows = entries(folder)
    lines = [f"# Index of `{folder}`", "", FOLDERS[folder], "",
             "Generated by `python -m bench.results_index` (do not edit by hand). *Commit*: the one the file "
             "records, or, for files written before results recorded it, the last commit that changed the file "
             "(≤: the code that made it is that commit's or older). ¹ The file records the command under the "
             "module or output folder it had when it ran; shown here as it runs today.", "",
             "| file | also | command | commit | date |", "|---|---|---|---|---|"]
    for e in rows:
        rel = e.path.relative_to(folder).as_posix()
        also = ", ".join(f"[`{c.suffix}`]({c.relative_to(folder).as_posix()})" for c in e.companions) or "–"
        command = f"`{e.command}`" if e.command else "–"
        if e.command and e.recorded_command and e.command != e.recorded_command:
            command += " ¹"
        lines.append(f"| [`{rel}`]({rel}) | {also} | {command.replace('|', '&#124;')} | {e.commit} | "
                     f"{(e.date or '–')[:10]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if an index is out of date")
    args = parser.parse_args(argv)
    stale = []
    for folder in FOLDERS:
        path = ROOT / folder / INDEX_NAME
        text = markdown(folder)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)} ({text.count(chr(10)) - 7} rows)")
    if stale:
        print(f"out of date: {', '.join(stale)} (run python -m bench.results_index)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
