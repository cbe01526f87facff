"""Research probes: ideas for making predicted weight updates pay, measured (most did not), kept
as evidence. Each is run as ``python -m experiments.<name>`` from the repository root and writes
to ``experiments/results``; ``experiments/README.md`` gives one entry per idea."""
