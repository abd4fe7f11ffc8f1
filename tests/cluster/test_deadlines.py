"""The sync batch's decode-time floor (cluster/wire/deadlines.py) against hand arithmetic, and a
cluster.step_timeout_s below it refused at load naming the figures (cluster.mode=sync on vLLM GPUs)."""
import json

import pytest

from sonar.cluster.wire.config import load_config
from sonar.cluster.wire.deadlines import MS_PER_1K_CTX, REF_KV_BYTES, REF_WEIGHT_BYTES, T0_MS, sync_batch_floor

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 131072}


def test_the_floor_is_waves_times_steps_times_the_weight_and_kv_reads():
    cfg = load_config(["r1_searcher"], [], notes=[])
    weights, kv = 2 * 8.03e9, 131_072  # an 8B in bf16; Llama-3.1-8B's KV per token
    f = sync_batch_floor(cfg, weights, kv)
    rows = 65 * 16  # one engine takes the whole batch
    assert (f.rows, f.waves, f.steps) == (rows, 5, 8 * 512)  # ceil(1040 / 256) waves of 8 turns x 512 tokens
    step_ms = T0_MS * weights / REF_WEIGHT_BYTES / 2 + 256 * (4096 / 2) / 1000 * MS_PER_1K_CTX * kv / REF_KV_BYTES / 2
    assert f.step_ms == pytest.approx(step_ms) and f.seconds == pytest.approx(5 * 4096 * step_ms / 1000)
    assert 550 < f.seconds < 600  # the preset's old 600 s deadline sat just above this floor


def test_a_deadline_below_the_floor_is_refused_and_the_preset_clears_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    (tmp_path / "tokenizer_config.json").write_text("{}")  # validate checks a model dir has its tokenizer
    assert load_config(["r1_searcher"], [f"model.path={tmp_path}"], notes=[]).cluster.step_timeout_s == 3600
    with pytest.raises(ValueError, match=r"cluster.step_timeout_s=500 bounds a whole sync batch .* at least 57\d s: "
                                         r"1,040 rows per engine in 5 wave\(s\)"):
        load_config(["r1_searcher"], [f"model.path={tmp_path}", "cluster.step_timeout_s=500"], notes=[])
    # async mode: the deadline bounds one learner step, not a batch's generation
    load_config(["r1_searcher", "async"], [f"model.path={tmp_path}", "cluster.step_timeout_s=500"], notes=[])
