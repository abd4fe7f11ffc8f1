"""End to end (slow): configs/smoke.yaml with configs/lora.yaml through the real driver, on the transformers
engines, on vLLM, and colocated (the push a hand-over). The learner trains adapters only, every push moves
exactly the adapters' bytes, every worker ends holding the learner's weights, and the run's model is the
merged policy with its peft adapter beside it."""
import json

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.ray]


VARIANTS = {"hf": ["rollout.engine=hf"], "vllm": ["rollout.engine=vllm"],
            # the push as a hand-over through a segment learner and engines both map (shared memory on CPU)
            "colocated": ["rollout.engine=hf", "cluster.placement=colocated", "cluster.mode=sync"]}


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm), "colocated"])
def lora_run(request, tmp_path_factory, shared_ray):
    from sonar.cluster.driver.loop import train
    from sonar.cluster.wire.config import CONFIG_DIR, load_config

    root = tmp_path_factory.mktemp("runs")
    cfg = load_config([CONFIG_DIR / "smoke.yaml", CONFIG_DIR / "lora.yaml"],
                      [f"run.root={root}", f"run.run_dir={root / 'lora'}", *VARIANTS[request.param]])
    return cfg, train(cfg)


def adapter_bytes(cfg, policy_dir) -> tuple[int, int]:
    """(the adapters' bytes, the whole policy's bytes) of the run's policy under ``learner.lora``."""
    from sonar.cluster.wire.policy import load_policy, with_lora

    model, _ = load_policy(policy_dir)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    peft = with_lora(model, cfg.learner.lora, cfg.run.seed)
    return sum(p.numel() * p.element_size() for p in peft.parameters() if p.requires_grad), full


def test_every_push_moves_only_the_adapters_and_the_workers_end_with_the_learners_weights(lora_run):
    cfg, s = lora_run
    adapters, full = adapter_bytes(cfg, f"{s['run_dir']}/policy")
    assert 0 < adapters < full / 4
    assert s["weights"]["push_bytes"] == adapters
    rows = [json.loads(line) for line in open(f"{s['run_dir']}/metrics.jsonl")]
    pushed = [r["weights/bytes"] for r in rows if "weights/bytes" in r]
    assert pushed and all(b == adapters for b in pushed)
    learner = s["weights"]["learner"]
    for w in s["weights"]["workers"]:
        assert w["version"] == learner["version"]
        assert w["checksum"] == pytest.approx(learner["checksum"], rel=1e-12)
    assert s["replay"]["balanced"] and s["learner_steps"] == sum(st.steps for st in cfg.stages)


def test_the_runs_model_is_the_merged_policy_with_its_adapter_beside_it(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, s = lora_run
    from pathlib import Path

    logged = list(Path(cfg.run.root).rglob(f"{s['mlflow_run_id']}/artifacts/adapter/adapter_model.safetensors"))
    assert len(logged) == 1, "the adapter is logged to MLflow beside the merged model"
    merged = AutoModelForCausalLM.from_pretrained(f"{s['run_dir']}/model", local_files_only=True)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(f"{s['run_dir']}/policy", local_files_only=True)
    peft = PeftModel.from_pretrained(base, f"{s['run_dir']}/model/adapter")
    ids = torch.tensor([[3, 8, 12, 5, 9]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        trained = peft(input_ids=ids).logits
        with peft.disable_adapter():
            assert not torch.allclose(trained, peft(input_ids=ids).logits)  # the adapter learned something
