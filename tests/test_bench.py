"""int8attn.bench: the recorder's incremental saves and the commit rows carry."""

import json

from int8attn import bench


def test_recorder_saves_each_row_once(tmp_path):
    rec = bench.Recorder("t", path=tmp_path / "rows.jsonl")
    rec.add(case="a", us=1.0)
    rec.save()
    rec.add(case="b", us=2.0)
    rec.save()
    rec.save()
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["case"] for r in rows] == ["a", "b"]
    assert all("gpu" in r and "triton" in r for r in rows)


def test_commit_named_by_the_caller_wins(monkeypatch):
    monkeypatch.setenv("INT8ATTN_COMMIT", "abc1234")
    assert bench.source_commit() == "abc1234"
    assert bench.environment()["commit"] == "abc1234"
    monkeypatch.delenv("INT8ATTN_COMMIT")
    found = bench.source_commit()
    assert found is None or (found != "abc1234" and len(found) >= 7)
