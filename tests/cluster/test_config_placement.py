"""Config refusals for the vLLM engine and the weight broadcast's placement: what would otherwise fail
only once the roles start (NCCL with a CPU rank, two NCCL ranks on one GPU, a directory vLLM cannot
load) fails at load, naming the fields."""
from __future__ import annotations

import json

import pytest

from sonar.cluster.wire.config import broadcast_backend, engine_dtype, load_config


def load(*overrides: str):
    return load_config([], list(overrides))


@pytest.mark.parametrize("overrides, backend", [
    ((), "gloo"),
    (("learner.num_gpus=1",), "gloo"),                                   # a CPU worker: gloo
    (("learner.num_gpus=1", "rollout.num_gpus_per_worker=1"), "nccl"),
    (("learner.num_gpus=1", "rollout.num_gpus_per_worker=1", "learner.dist_backend=gloo"), "gloo"),
    (("learner.num_gpus=0.5",), "gloo"),                                 # gloo: a shared GPU is no problem
])
def test_the_broadcast_uses_nccl_only_when_every_rank_has_a_gpu(overrides, backend):
    assert broadcast_backend(load(*overrides)) == backend


@pytest.mark.parametrize("overrides", [
    ("learner.dist_backend=nccl",),
    ("learner.dist_backend=nccl", "learner.num_gpus=1"),                 # GPU learner, CPU workers
    ("learner.dist_backend=nccl", "rollout.num_gpus_per_worker=1"),      # CPU learner, GPU workers
])
def test_nccl_with_a_cpu_rank_is_refused_naming_the_fields(overrides):
    with pytest.raises(ValueError, match=r"learner\.dist_backend='nccl'.*learner\.num_gpus=.*rollout\.num_gpus_per_worker="):
        load(*overrides)


@pytest.mark.parametrize("overrides, named", [
    (("learner.num_gpus=0.5", "rollout.num_gpus_per_worker=0.5"), r"learner\.num_gpus=0\.5, rollout\.num_gpus_per_worker=0\.5"),
    (("learner.num_gpus=1", "rollout.num_gpus_per_worker=0.5"), r"rollout\.num_gpus_per_worker=0\.5"),
    (("learner.num_gpus=1.5", "rollout.num_gpus_per_worker=1"), r"learner\.num_gpus=1\.5"),
])
def test_fractional_gpus_under_nccl_are_refused(overrides, named):
    with pytest.raises(ValueError, match=named + ".*NCCL"):
        load(*overrides)


def test_a_model_directory_vllm_cannot_load_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"model\.path=.* is not a Hugging Face model directory: config\.json and "
                                         r"tokenizer files \(tokenizer\.json / .*\) missing there"):
        load("rollout.engine=vllm", f"model.path={tmp_path}")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model\.path=.*: config\.json missing there"):
        load(f"model.path={tmp_path}")  # whatever the engine
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match=r"model\.path=.*: config\.json and tokenizer files"):
        load(f"model.path={tmp_path}")  # a folder named config.json is no config
    (tmp_path / "config.json").rmdir()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
    with pytest.raises(ValueError, match=r"model\.path=.*architectures"):
        load("rollout.engine=vllm", f"model.path={tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
    assert load("rollout.engine=vllm", f"model.path={tmp_path}").model.path == str(tmp_path)
    assert load("rollout.engine=vllm").model.path is None  # the run's tiny policy, saved for every role


@pytest.mark.parametrize("overrides, match", [
    (("rollout.weight_update=later",), r"rollout\.weight_update='later'"),
    (("rollout.vllm_dtype=int8",), r"rollout\.vllm_dtype='int8'"),
    (("rollout.tensor_parallel_size=0",), r"rollout\.tensor_parallel_size=0"),
    (("rollout.tensor_parallel_size=2",), r"rollout\.tensor_parallel_size=2 needs rollout\.engine='vllm'"),
    (("rollout.engine=vllm", "rollout.tensor_parallel_size=2", "rollout.num_gpus_per_worker=1"),
     r"rollout\.tensor_parallel_size=2 > rollout\.num_gpus_per_worker=1"),
    (("rollout.vllm_kv_cache_gib=-1",), r"rollout\.vllm_kv_cache_gib=-1"),
    (("rollout.vllm_kv_cache_gib=.inf",), r"rollout\.vllm_kv_cache_gib=inf"),
    (("rollout.vllm_gpu_memory_utilization=0",), r"rollout\.vllm_gpu_memory_utilization=0"),
    (("rollout.vllm_gpu_memory_utilization=1.5",), r"rollout\.vllm_gpu_memory_utilization=1\.5"),
    (("rollout.engine=vllm", "rollout.continuous_batching=true"), r"rollout\.continuous_batching=True"),
])
def test_bad_vllm_fields_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        load(*overrides)


@pytest.mark.parametrize("overrides, dtype", [
    ((), "float32"),                                          # CPU learner: float32, as vLLM's "auto" is not
    (("learner.num_gpus=1",), "bfloat16"),                    # learner.precision=auto on a GPU: bf16
    (("learner.num_gpus=1", "learner.precision=fp32"), "float32"),
    (("rollout.vllm_dtype=float16",), "float16"),
])
def test_the_engine_computes_in_the_learners_precision_unless_told(overrides, dtype):
    assert engine_dtype(load(*overrides)) == dtype


def test_tensor_parallel_on_whole_gpus_loads():
    cfg = load("rollout.engine=vllm", "rollout.tensor_parallel_size=2", "rollout.num_gpus_per_worker=2",
               "learner.num_gpus=1", "rollout.weight_update=interrupt")
    assert broadcast_backend(cfg) == "nccl" and cfg.rollout.weight_update == "interrupt"
