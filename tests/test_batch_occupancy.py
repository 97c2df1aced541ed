"""scripts/batch_occupancy.py: the schedule arithmetic on hand-checked cases (no model)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import batch_occupancy as bo  # noqa: E402


def test_schedules_by_hand():
    cost = lambda c: 1.0 + c  # ms per round at c rows
    # C=4: rounds 8, 2, 1, 1. Static: 8 rounds at 4 rows. Shrinking: live 4 (t=0), 2 (t=1: -> 2 rows), then 1
    # (t>=2: -> 1 row): 1 x 5 + 1 x 3 + 6 x 2 = 20 ms + 2 returns. Free refill of one batch = the batch itself.
    s = bo.schedule_ms([[8, 2, 1, 1]], cost, 4, return_ms=0.5)
    assert s["batch_rounds"] == 8 and s["live_row_rounds"] == 12 and s["row_rounds"] == 32
    assert s["static_ms"] == 8 * 5 and s["shrink_returns"] == 2 and s["shrinking_ms"] == 20 + 2 * 0.5
    assert s["refill_rounds"] == 8 and s["refill_ms"] == 40
    # two batches through 2 rows: static 4 + 3 rounds; refilled, requests in order, each to the row that frees
    # first: row 0 runs 4, row 1 runs 1 + 1 + 3 = 5 rounds
    s = bo.schedule_ms([[4, 1], [1, 3]], cost, 2, return_ms=0.0)
    assert s["batch_rounds"] == 7 and s["static_ms"] == 7 * 3
    assert s["refill_rounds"] == 5 and s["refill_ms"] == 15
    # shrinking: batch 1 live 2,1,1,1 -> 3 + 2 + 2 + 2; batch 2 live 2,1,1 -> 3 + 2 + 2
    assert s["shrinking_ms"] == 9 + 7 and s["shrink_returns"] == 2


def test_round_costs_reads_static_rows():
    bench = {"rows": [dict(method="ar", temperature=0.0, concurrency=1, ms_per_round=1.2),
                      dict(method="ar", temperature=0.0, concurrency=32, ms_per_round=2.6),
                      dict(method="ar", temperature=0.0, concurrency=32, ms_per_round=9.9, continuous=True),
                      dict(method="ar", temperature=0.7, concurrency=8, ms_per_round=5.0)]}
    assert bo.round_costs(bench, "ar") == {1: 1.2, 32: 2.6}


def test_unpriced_method_is_counted_not_priced(tmp_path, capsys):
    # a method without static rows in --costs is still counted (batch rounds 2 + 1, occupancy 5 of 6 row-rounds),
    # just not priced
    bench = {"device": "x", "rows": [dict(method="ar", temperature=0.0, concurrency=c, ms_per_round=1.0 + c / 32)
                                     for c in (1, 32)]}
    (tmp_path / "costs.json").write_text(json.dumps(bench))
    rounds = {"ar": [[4, 3], [2, 2]], "ddtree:2": [[2, 1], [1, 1]]}
    (tmp_path / "rounds.json").write_text(json.dumps({"rounds": rounds}))
    assert bo.round_costs(bench, "ddtree:2") == {}
    out = tmp_path / "out.json"
    assert bo.main(["--costs", str(tmp_path / "costs.json"), "--rounds-json", str(tmp_path / "rounds.json"),
                    "--methods", "ar,ddtree:2", "--concurrency", "2", "--batches", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "counted, not priced" in text and "| ddtree:2 | 3 | 83% | no costs |" in text
    assert json.loads(out.read_text())["methods"]["ddtree:2"]["batch_rounds"] == 3
