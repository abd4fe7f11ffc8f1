"""README's colocated-placement block (``default_run.render_placements_table``): one row per setting, EM per
seed, and the verdict on whether every colocated seed lies inside each split setting's spread."""
from sonar.bench.default_run import render_placements_table


def _doc(placement, mode, ems, overrides=True):
    runs = [{"seed": s, "em_before_search": 0.8, "em_after_search": e, "eval_n": {"after_search": 375},
             "loadavg": {"start": [2.5 + s, 1.0, 1.0]}} for s, e in enumerate(ems)]
    over = [f"cluster.placement={placement}", f"cluster.mode={mode}"] if overrides else []
    return {"config": {"overrides": over, "resolved": {"cluster": {"placement": placement, "mode": mode}}},
            "extra": {"runs": runs}, "commit": "0123456789abcdef", "timestamp": "2026-12-06T10:00:00",
            "metrics": {"trajectories_per_s": {"median": 150.0}, "command_wall_s": {"median": 300.0}}}


def test_rows_per_setting_and_the_spread_verdict():
    out = render_placements_table([("c.json", _doc("colocated", "sync", [0.91, 0.93])),
                                   ("s.json", _doc("split", "sync", [0.90, 0.94])),
                                   ("a.json", _doc("split", "async", [0.92, 0.95], overrides=False))])
    assert out.startswith("<!-- default-run placements table: bench/results/c.json, bench/results/s.json, "
                          "bench/results/a.json")
    assert "| colocated, sync | 80.0 % → **91.0 %** | 80.0 % → **93.0 %** | 2.5, 3.5 |" in out
    assert "| split, async |" in out  # the preset's own setting, read from the resolved config
    assert "inside the spread of split sync (90.0 % to 94.0 %)" in out
    assert "at or below the spread of split async (92.0 % to 95.0 %)" in out  # 91.0 % < 92.0 %
    assert "binomial standard error of 1.4 pt at 375 questions" in out  # mean EM 92.5 %: sqrt(.925 x .075 / 375)
    assert out.endswith("<!-- /default-run placements table -->")
