"""The held-out nowcasting benchmark's quick mode runs end to end on the shipped nowcaster."""
from __future__ import annotations

import math

from bench import nowcast_heldout as bench


def test_quick_mode_runs(tmp_path, capsys):
    bench.main(["--quick", "--out", str(tmp_path / "heldout")])
    text = capsys.readouterr().out
    assert "| cosine+nc:reset |" in text and "| adam |" in text and "| sf+nc |" in text and "| muon+nc:reset |" in text
    # The nowcast arms made their three calls; the plain arms none.
    assert text.split("| cosine+nc:reset |")[1].splitlines()[0].endswith("(3) |")
    assert text.split("| adam |")[1].splitlines()[0].endswith("(0) |")


def test_jumper_adds_exactly_the_prediction():
    import torch

    from bench import nowcaster_family as fam
    from hybrid_trainer import nowcaster as nc

    model = fam.SmallCNN([4, 4])
    caster = nc.build_nowcaster("weight")
    jumper = bench.Jumper(caster, model, spacing=1)
    for i in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (i + 1))
        jumper.snapshot()
    assert jumper.ready
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    expected = caster.predict(torch.stack(jumper.snaps), jumper.layout, 3)
    rel = jumper.jump(3)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(after - before, expected, rtol=0, atol=1e-6)
    assert math.isfinite(rel) and not jumper.ready
