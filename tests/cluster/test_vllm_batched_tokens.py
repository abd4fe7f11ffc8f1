"""vLLM's per-step token budget follows the batch and the model (``rollout.vllm_max_num_batched_tokens``):
derived on GPU so every running row decodes and one longest prefill fits beside them, on CPU so a whole
prefill fits one step (chunked prefill off); a hand-set value below that is refused naming the fields."""
import pytest

from sonar.cluster.wire.config import CONFIG_DIR, load_config, vllm_batched_tokens


def _cfg(*overrides):
    return load_config([CONFIG_DIR / "tiny.yaml"], ["rollout.engine=vllm", "model.max_position_embeddings=8192",
                                                   *overrides])


def test_derived_budget_on_gpu_holds_every_rows_decode_and_one_longest_prefill():
    cfg = _cfg("rollout.max_batch_rows=512", "protocol.max_total_tokens=4096")
    assert vllm_batched_tokens(cfg, on_gpu=True) == 512 + 4096  # vLLM's own default would be 2,048
    assert vllm_batched_tokens(cfg, on_gpu=False) == 4096
    assert vllm_batched_tokens(_cfg("protocol.max_total_tokens=1024"), on_gpu=False) == 4096
    assert vllm_batched_tokens(_cfg("rollout.vllm_max_num_batched_tokens=9000"), on_gpu=True) == 9000


def test_a_budget_too_small_for_the_batch_or_the_prefill_is_refused():
    with pytest.raises(ValueError, match=r"vllm_max_num_batched_tokens=256 < rollout.max_batch_rows=512: at most "
                                         r"256 of the rows could decode"):
        _cfg("rollout.vllm_max_num_batched_tokens=256", "rollout.max_batch_rows=512", "rollout.num_gpus_per_worker=1",
             "learner.num_gpus=1")
    with pytest.raises(ValueError, match=r"vllm_max_num_batched_tokens=1000 < protocol.max_total_tokens=2048: "
                                         r"chunked prefill is off on CPU"):
        _cfg("rollout.vllm_max_num_batched_tokens=1000", "protocol.max_total_tokens=2048")
