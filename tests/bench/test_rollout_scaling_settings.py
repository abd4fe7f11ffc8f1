"""The settings ``sonar bench rollout-scaling`` measures (bench/rollout_scaling.py): the sleeping BENCHMARK
engine by default, a real vLLM engine on a policy whose decode dominates with ``--engine vllm``. The configs
are loaded as the benchmark loads them; no Ray, no engine. (The vLLM run itself takes minutes on 2 cores:
its figures are in bench/README.md, not a test.)"""
from __future__ import annotations

import pytest

from sonar.bench import driver_harness as H
from sonar.bench import rollout_scaling as R


def test_the_default_runs_the_sleeping_engine_on_the_tiny_policy():
    full, _ = R.settings(["--allow-dirty"])
    quick, _ = R.settings(["--allow-dirty", "--quick"])
    assert full["workers"] == [1, 2, 4, 8] and quick["workers"] == [1, 2]
    for b in (full, quick):
        assert b["engine"] == "bench" and b["sim"]["engine"] == "bench"
        assert b["resolved"]["rollout"]["engine"] == "hf" and b["resolved"]["model"]["num_layers"] == 2


def test_engine_vllm_runs_a_real_engine_on_a_policy_whose_decode_dominates():
    full, _ = R.settings(["--allow-dirty", "--engine", "vllm"])
    quick, _ = R.settings(["--allow-dirty", "--engine", "vllm", "--quick"])
    assert (full["workers"], full["warmup_s"], full["window_s"], full["repeats"]) == ([1, 2], 30.0, 60.0, 2)
    assert (quick["workers"], quick["repeats"]) == ([1, 2], 1)
    for b in (full, quick):
        r = b["resolved"]
        assert b["sim"]["engine"] == "real" and r["rollout"]["engine"] == "vllm"  # nothing simulated
        assert (r["model"]["hidden_size"], r["model"]["num_layers"]) == (512, 8)
        assert r["stages"][0]["steps"] == 0  # untrained: one turn decoded to its cap, no SFT
    # what the command line says wins over the preset's choices
    mine, _ = R.settings(["--allow-dirty", "--engine", "vllm", "--workers", "2", "--repeats", "3", "model.num_layers=4"])
    assert mine["workers"] == [2] and mine["repeats"] == 3 and mine["resolved"]["model"]["num_layers"] == 4


def test_the_engine_choice_is_checked():
    with pytest.raises(SystemExit):
        R.settings(["--allow-dirty", "--engine", "tgi"])


def test_parameters_are_counted_from_the_safetensors_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2, dtype=torch.bfloat16)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert R._params_m(str(tmp_path)) == pytest.approx((12 + 5 + 8) / 1e6)


def test_the_plot_title_says_the_recorded_load_not_a_fixed_claim():
    import os

    note = H.load_note({"start": [0.52, 1.0, 1.25], "end": [3.1, 2.0, 1.5]})
    assert note == (f"{os.cpu_count()}-core machine; load average (1/5/15 min) 0.5/1.0/1.2 at the start, "
                    "3.1/2.0/1.5 at the end, this benchmark's own processes included")
    assert "n/a at the end" in H.load_note({"start": None})  # a run stopped before its end, or no getloadavg
