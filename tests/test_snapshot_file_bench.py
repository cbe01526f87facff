"""bench.snapshot_file: times the trainer's own file store after each idle gap and says how."""
import json

from bench import snapshot_file


def test_it_times_every_save_through_the_trainers_store_and_writes_both_files(tmp_path, monkeypatch):
    saved = []
    from hybrid_trainer import anchor

    save = anchor.WeightAnchor.save

    def counting_save(self, step, optimizer=None):
        saved.append((self.storage, step))
        return save(self, step, optimizer)

    monkeypatch.setattr(anchor.WeightAnchor, "save", counting_save)
    assert snapshot_file.main(["--model", "tiny", "--idle", "0", "0.01", "--repeats", "3", "--out", str(tmp_path)]) == 0
    assert saved == [("file", 0)] + [("file", r) for r in (1, 2, 3) for _ in range(2)]
    results = json.loads((tmp_path / "snapshot_file.json").read_text())
    r = results["result"]
    assert results["command"].startswith("python -m bench.snapshot_file --model tiny")
    # fp32 weights, AdamW's two moments and its fp32 step count per tensor (the tiny MLP has 4 tensors)
    assert r["state_bytes"] == 3 * 4 * r["parameters"] + 4 * 4
    assert list(r["saves"]) == ["0.0", "0.01"] and all(len(v) == 3 for v in r["saves"].values())
    assert all(s["cpu_ms"] >= 0 and s["wall_ms"] > 0 for v in r["saves"].values() for s in v)
    text = (tmp_path / "snapshot_file.md").read_text()
    assert "| 0.01 | 3 |" in text and f"{r['parameters'] / 1e6:.2f}M parameters" in text


def test_damon_schemes_are_read_from_sysfs(tmp_path, monkeypatch):
    context = tmp_path / "0" / "contexts" / "0"
    scheme = context / "schemes" / "0"
    for path, value in {tmp_path / "0" / "state": "on", context / "monitoring_attrs/intervals/aggr_us": "5000000",
                        scheme / "access_pattern/age/min": "12", scheme / "action": "pageout",
                        scheme / "ops_filters/0/allow": "N", scheme / "ops_filters/0/type": "anon",
                        scheme / "ops_filters/1/allow": "Y", scheme / "ops_filters/1/type": "unmapped"}.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    monkeypatch.setattr(snapshot_file, "DAMON", tmp_path)
    assert snapshot_file.damon_schemes() == [dict(action="pageout", min_age_s=60.0,
                                                  filters=["reject anon", "allow unmapped"])]
    (tmp_path / "0" / "state").write_text("off\n")
    assert snapshot_file.damon_schemes() == []
