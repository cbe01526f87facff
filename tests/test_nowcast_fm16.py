"""NiNo's FM-16 protocol: the model layout and the comparison with NiNo's figures."""
from __future__ import annotations

import torch

from bench import nowcast_fm16 as fm16
from bench import nowcaster_family as fam


def test_fm16_model_is_ninos_layout():
    model = fam.make_model(dict(fm16.SPEC, seed=0))
    assert sum(p.numel() for p in model.parameters()) == 14_378
    feats = model.features(torch.zeros(2, 1, 28, 28))
    assert feats.shape == (2, 32, 13, 13)  # stride 2 unpadded, then stride 1 'same'


def _curve(accs):
    return [dict(step=200 * i, acc=a, loss=1.0, train_s=float(i)) for i, a in enumerate(accs)]


def test_reach_and_verdict_against_ninos_steps():
    curve = _curve([0.5, 0.886, 0.89, 0.894])
    assert fm16.reach(curve, 0.885) == (200, 1.0) and fm16.reach(curve, 0.893) == (600, 3.0)
    assert fm16.reach(curve, 0.95) == (None, None)
    results = dict(targets=list(fm16.TARGETS), nino_reference=fm16.NINO_REFERENCE,
                   runs={"adam+nc": dict(curve=curve), "adam": dict(curve=curve),
                         "cosine+nc:reset": dict(curve=_curve([0.5] * 30 + [0.886] * 3 + [0.9]))})
    lines = fm16.verdict(results)
    assert len(lines) == 2  # the nowcast arms only
    assert "at least NiNo's" in lines[0]  # 200 / 600 steps against NiNo's 3,600 / 4,400
    assert "short of NiNo's" in lines[1]  # 6,000 / 6,600 steps


def test_verdict_compares_like_with_like():
    """Each nowcast arm over this repository's own plain loop and tuned cosine run, beside NiNo's
    speed-ups over its own baselines."""
    adam, cosine = _curve([0.5] * 20 + [0.886] * 5 + [0.9]), _curve([0.5] * 10 + [0.886] * 5 + [0.9])
    fast = _curve([0.5] * 5 + [0.886] * 5 + [0.9])
    results = dict(targets=list(fm16.TARGETS), nino_reference=fm16.NINO_REFERENCE, cosine_lr=0.01,
                   tuning={"0.01": dict(curve=cosine)}, runs={"adam": dict(curve=adam), "adam+nc": dict(curve=fast)})
    (line,) = fm16.verdict(results)
    # adam reaches 88.5% at step 4,000 and 89.3% at 5,000; cosine at 2,000 / 3,000; the arm at 1,000 / 2,000
    assert "Over this repository's `adam` run: 4.00× / 2.50×" in line
    assert "Over this repository's `cosine` run: 2.00× / 1.50×" in line
    assert "NiNo over its Adam baseline: 1.78× / the plain loop never reached it" in line
    assert "NiNo over its tuned cosine run: 1.44× / 1.45×" in line


def test_readme_row_reads_steps_and_verdict_from_the_file(tmp_path, monkeypatch):
    import json

    from bench import readme_tables

    fast, slow = _curve([0.5] * 5 + [0.886] * 5 + [0.9]), _curve([0.5] * 30 + [0.886] * 3 + [0.9])
    data = dict(command="python -m bench.nowcast_fm16 --arms adam+nc", targets=list(fm16.TARGETS),
                runs={"adam": dict(curve=slow, final_acc=0.89), "adam+nc": dict(curve=fast, final_acc=0.9)},
                tuning={"0.01": dict(curve=slow, final_loss=0.3, final_acc=0.89)}, cosine_lr=0.01)
    (tmp_path / "nowcast_fm16.json").write_text(json.dumps(data))
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    ((_, measured, command),) = readme_tables._fm16_rows()
    assert "`adam+nc` 1,000 / 2,000 (final 90.00%)" in measured and "`adam` 6,000 / 6,600 (final 89.00%)" in measured
    assert "`cosine` 6,000 / 6,600" in measured and "3,600 / 4,400 (final 89.28%)" in measured
    assert "**at least NiNo's figures**: `adam+nc`" in measured
    assert command == "`python -m bench.nowcast_fm16 --arms adam+nc`"
    data["runs"]["adam+nc"] = dict(curve=slow, final_acc=0.89)
    (tmp_path / "nowcast_fm16.json").write_text(json.dumps(data))
    assert "**no arm reaches NiNo's figures**" in readme_tables._fm16_rows()[0][1]
