"""LoRA in the learner (``learner.lora``, ``learner/lora.py``): only the adapters train and travel, the KL
reference is the stage's start without a second model, a KL stage resumes bit for bit, and the export is a
peft adapter plus the merged model that generates what the learner's policy generates."""
from __future__ import annotations

import pytest
import torch

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.config import load_config
from sonar.cluster.wire.policy import ADAPTER_DIR
from sonar.learner.worker import REFERENCE_FILE
from tests.learner.test_critic import singleton_groups
from tests.learner.test_learner_sft import policy  # noqa: F401  (module fixture: a tiny policy directory)

KL_STAGE = ("stages=[{kind: rl, steps: 8, lr: 0.003, algo: {name: reinforce_pp, kl_coef: 0.5, kl_mode: loss, "
            "kl_estimator: k3}}]")


def lora_learner(policy, *extra):
    from tests.learner.test_train_step import init_deepspeed

    init_deepspeed()
    from sonar.learner.worker import Learner

    cfg = load_config([], ["learner.warmup_steps=0", "rollout.group_size=1", "learner.lora.rank=4",
                           "learner.lora.alpha=8", KL_STAGE, *extra])
    return cfg, Learner(cfg, str(policy))


def _steps(lrn, stage, seeds):
    for s in seeds:
        m = lrn.train_groups(singleton_groups(s, version=lrn.version), [0] * 6, stage)
        lrn._finish_step(m, m.pop(K.LEARNER_LR))


def _logits(module, ids):
    was = module.training
    module.eval()
    try:
        with torch.no_grad():
            return module(input_ids=ids).logits
    finally:
        module.train(was)


def snapshot(lrn) -> dict:
    """Every parameter of the policy, reference adapter included, as full copies (gathered under ZeRO-3)."""
    with lrn._gathered(list(lrn.engine.module.named_parameters())) as views:
        return {n: t.clone() for n, t in views.items()}


IDS = torch.tensor([[5, 9, 11, 7, 20, 13, 4, 8]])


@pytest.mark.parametrize("zero", [0, 3])
def test_lora_trains_and_pushes_only_the_adapters_and_the_reference_is_the_stage_start(policy, zero):  # noqa: F811
    """ZeRO-3 too: the adapters peft adds after the partitioned load are partitioned by DeepSpeed, and the
    reference adapter is written through the gathers (``set_reference``); unchunked logits there, as the
    config requires (``_check_learner``: chunked logits under ZeRO-3 fail for a frozen head)."""
    cfg, lrn = lora_learner(policy, f"learner.zero_stage={zero}", f"learner.logits_chunk_tokens={0 if zero == 3 else 8}")
    stage = cfg.stages[0]
    module = lrn.engine.module
    specs = lrn.param_specs()
    assert specs and all(".lora_" in s.name and ".default." in s.name for s in specs)
    pushed = sum(torch.Size(s.shape).numel() for s in specs)
    total = sum(getattr(p, "ds_numel", p.numel()) for n, p in module.named_parameters()  # ZeRO-3: the full size
                if ".reference." not in n)
    assert pushed < total / 5  # rank 4 on a 16-wide model: adapters are a small share of what is served
    lrn.begin_stage(0, stage)
    start = _logits(module, IDS)
    assert torch.equal(_logits(lrn.ref_module, IDS), start)  # the stage starts at its reference
    before = snapshot(lrn)
    _steps(lrn, stage, (0, 1))
    assert lrn._set_lr(stage) == pytest.approx(0.003 * cfg.learner.lora.lr_scale)  # LoraConfig.lr_scale
    after = snapshot(lrn)
    changed = {n for n, t in after.items() if not torch.equal(t, before[n])}
    assert changed and all(".lora_" in n and ".default." in n for n in changed), sorted(changed)[:4]
    assert any(".lora_B." in n for n in changed)  # B starts at 0: the adapter now changes the output
    assert not torch.allclose(_logits(module, IDS), start)
    assert torch.equal(_logits(lrn.ref_module, IDS), start)  # the reference stayed at the stage's start
    # the reference is no copy of the model: one adapter beside the trained one
    ref_params = [n for n, _ in module.named_parameters() if ".reference." in n]
    assert len(ref_params) == len(specs) and not list(lrn.ref_module.parameters())


def test_a_resumed_lora_kl_stage_equals_the_uninterrupted_one(policy, tmp_path):  # noqa: F811
    cfg, a = lora_learner(policy)
    stage = cfg.stages[0]
    a.begin_stage(0, stage)
    start = _logits(a.engine.module, IDS)
    _steps(a, stage, (0,))
    a.save_checkpoint(str(tmp_path / "ckpt"), {})
    assert not (tmp_path / "ckpt" / REFERENCE_FILE).exists()  # the reference adapter is in the module state
    _steps(a, stage, (1, 2))
    expected = {k: v.clone() for k, v in a.engine.module.state_dict().items()}

    _, b = lora_learner(policy)
    b.load_checkpoint(str(tmp_path / "ckpt"))
    b.begin_stage(0, stage, b.stage_step)
    assert torch.equal(_logits(b.ref_module, IDS), start)  # the stage's start, not the resumed step's
    _steps(b, stage, (1, 2))
    got = b.engine.module.state_dict()
    diverged = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not diverged, f"a resumed LoRA stage diverged in {diverged[:5]}"


def test_the_export_is_a_peft_adapter_and_the_merged_model_generating_the_same(policy, tmp_path):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, lrn = lora_learner(policy)
    stage = cfg.stages[0]
    lrn.begin_stage(0, stage)
    _steps(lrn, stage, (0, 1, 2))
    with torch.no_grad():  # a large adapter, so a wrong merge (scale, transpose, a layer left out) shows
        for n, p in lrn.engine.module.named_parameters():
            if ".lora_B.default." in n:
                p.normal_(0, 0.5)
    out = lrn.export_hf(str(tmp_path / "export"))
    learner_logits = _logits(lrn.engine.module, IDS)

    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged, IDS), learner_logits, rtol=1e-4, atol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(str(policy), local_files_only=True)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "export" / ADAPTER_DIR))
    torch.testing.assert_close(_logits(peft, IDS), learner_logits, rtol=1e-5, atol=1e-5)
    # greedy text: the same tokens from the merged export as from the learner's policy
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    lrn.engine.module.eval()
    with torch.no_grad():
        ours = lrn.engine.module.generate(input_ids=IDS, **gen)
        theirs = merged.generate(input_ids=IDS, **gen)
    assert torch.equal(ours, theirs)


def test_an_engine_holding_the_pushed_adapters_has_the_learners_checksum(policy):  # noqa: F811
    """The transformers engine wraps the same policy alike (``with_lora``, same seed): its push layout is the
    learner's adapters, and after taking the pushed tensors its checksum is the learner's."""
    from sonar.actors.engine import HFEngine
    from sonar.cluster.transport.weights import checksum
    from sonar.cluster.wire.buckets import layout_digest
    from sonar.cluster.wire.policy import load_policy, with_lora

    cfg, lrn = lora_learner(policy)
    stage = cfg.stages[0]
    lrn.begin_stage(0, stage)
    model, tok = load_policy(str(policy))
    eng = HFEngine(with_lora(model, cfg.learner.lora, cfg.run.seed), eos_token_id=tok.eos_token_id)
    specs = lrn.param_specs()
    assert layout_digest(eng.parameter_specs()) == layout_digest(specs)

    def engine_sum():  # what a rollout worker reports (``RolloutWorker.checksum``): its pushed tensors
        return checksum((n, p) for n, p in eng.model.named_parameters() if p.requires_grad)

    assert engine_sum() == pytest.approx(lrn.checksum()["checksum"], rel=1e-12)  # the same initial adapters
    _steps(lrn, stage, (0, 1))
    assert engine_sum() != pytest.approx(lrn.checksum()["checksum"], rel=1e-12)
    with lrn._gathered(lrn._pushed()) as views:
        eng.load_weights([(n, t.clone()) for n, t in views.items()], version=lrn.version)
    assert engine_sum() == pytest.approx(lrn.checksum()["checksum"], rel=1e-12)


def test_with_gradient_checkpointing_the_adapters_still_train(policy):  # noqa: F811
    """Every adapter gets a gradient through checkpointed layers behind the frozen embeddings (transformers'
    checkpointing is the non-reentrant kind; the reentrant kind would pass none through a segment whose inputs
    need none)."""
    cfg, lrn = lora_learner(policy, "learner.gradient_checkpointing=true")
    assert lrn.engine.module.is_gradient_checkpointing
    stage = cfg.stages[0]
    lrn.begin_stage(0, stage)
    before = snapshot(lrn)
    _steps(lrn, stage, (0,))
    after = snapshot(lrn)
    moved = [n for n in after if ".lora_B.default." in n and not torch.equal(after[n], before[n])]
    assert len(moved) == len([n for n in after if ".lora_B.default." in n])  # every adapter got a gradient


@pytest.mark.parametrize("zero", [0, 3])
@pytest.mark.parametrize("mode", ["separate", "head"])
def test_ppo_with_a_critic_trains_the_adapters_and_the_critic(policy, mode, zero):  # noqa: F811
    """RAG-R1's algorithm on LoRA: the critic stays a whole model (``separate``: its own trunk from the policy
    directory; ``head``: a value head on the policy's trunk, found under the peft wrapper)."""
    ppo = ("stages=[{kind: rl, steps: 8, lr: 0.001, algo: {name: ppo, kl_coef: 0.1, kl_mode: reward, "
           "kl_estimator: k1}}]")
    cfg, lrn = lora_learner(policy, ppo, f"critic.mode={mode}", "critic.warmup_steps=0", f"learner.zero_stage={zero}",
                            f"learner.logits_chunk_tokens={0 if zero == 3 else 8}")
    stage = cfg.stages[0]
    lrn.begin_stage(0, stage)
    before, head = snapshot(lrn), {k: v.clone() for k, v in lrn.critic.head.state_dict().items()}
    _steps(lrn, stage, (0, 1))
    after = snapshot(lrn)
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    assert changed and all(".lora_" in n and ".default." in n for n in changed)
    assert any(not torch.equal(v, head[k]) for k, v in lrn.critic.head.state_dict().items())  # the critic learned


def test_lora_under_zero3_with_chunked_logits_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match=r"learner\.lora\.rank=16 with learner\.zero_stage=3 and "
                                         r"learner\.logits_chunk_tokens=1024.*learner\.logits_chunk_tokens=0"):
        load_config(["lora"], ["learner.zero_stage=3"])
    assert load_config(["lora"], ["learner.zero_stage=3", "learner.logits_chunk_tokens=0"]).learner.zero_stage == 3
