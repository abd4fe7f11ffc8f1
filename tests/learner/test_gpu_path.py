"""What the learner's first GPU run needs, checked on CPU (issue 21, items 2, 8 and 9):

* every collective between the learner ranks puts its tensors on the learner's device: a group whose only
  backend serves CUDA (``"cuda:gloo"``, as an NCCL group has only a CUDA backend) refuses the CPU tensors
  the old code all-reduced, and none is issued outside ``learner/collectives.py``;
* the KL reference is held in the training dtype and, under ZeRO-3, is a partitioned DeepSpeed inference
  engine; no forward asks for (or keeps) every layer's hidden states;
* PPO's critic is a DeepSpeed engine like the policy;
* exports are written in the training dtype, one gathered parameter at a time under ZeRO-3;
* checkpoints carry the CUDA RNG state when CUDA is present and restore an older one without it;
* ZeRO-3 builds the policy inside ``zero.Init``: partitioned as it is loaded.

What only a GPU shows (NCCL accepting the device tensors, bf16 numerics on CUDA) is for
``bench/gpu_check.py``; the data-parallel splits of the no-grad forwards are also checked end to end in
test_data_parallel.py."""
from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sonar.cluster.wire.config import AlgoConfig, CriticConfig, LearnerConfig, ReplayConfig, load_config
from sonar.learner.batching import collate
from tests.learner.test_learner_sft import policy  # noqa: F401  (module fixture: a tiny policy directory)
from tests.learner.test_train_step import groups, init_deepspeed

ROOT = Path(__file__).resolve().parents[2]
REFUSED_CPU = "No backend type associated with device type cpu"


# -- collectives on the learner's device -------------------------------------------------------------

def _two_ranks(backend: str, tmp_path) -> list[dict]:
    from sonar.learner.worker import free_port

    out, port = tmp_path / f"{backend.replace(':', '_')}.pt", free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.learner.collective_ranks", str(r), "2", str(port), backend,
                               str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]


@pytest.mark.slow  # spawns processes (ranks / a CLI): `make test` runs it, `make test-fast` does not
def test_a_cuda_only_group_refuses_the_cpu_tensors_and_takes_the_given_device(tmp_path):
    """The old ``_dp_sum`` all-reduced ``torch.tensor([x])`` (CPU) and the object broadcasts let torch pick
    the device: on a group with only a CUDA backend (NCCL's case, reproduced by ``"cuda:gloo"``) a CPU tensor
    is refused with NCCL's message. Each learner collective puts its tensor on the device it is given: with
    ``meta`` the group does not refuse it (a meta tensor needs no backend), and what fails, if anything, is
    reading the value back from a tensor that holds none; so on a GPU, given ``engine.device``, the tensor
    is a CUDA one."""
    for res in _two_ranks("cuda:gloo", tmp_path):
        for name in ("dp_sum", "sum_disjoint_rows_", "broadcast_object", "barrier"):
            assert res[(name, "cpu")] is not None and REFUSED_CPU in res[(name, "cpu")], (name, res[(name, "cpu")])
        for name in ("dp_sum", "sum_disjoint_rows_", "broadcast_object"):
            err = res[(name, "meta")]
            assert err is None or ("No backend type" not in err and "meta" in err), (name, err)
        assert res[("sum_disjoint_rows_", "meta")] is None


@pytest.mark.slow  # spawns processes (ranks / a CLI): `make test` runs it, `make test-fast` does not
def test_the_learner_collectives_compute_on_a_cpu_group_and_split_the_no_grad_forwards(tmp_path):
    """The same collectives' values over 2 gloo ranks, and the data-parallel no-grad forwards: each rank
    forwards only its shard of the rows (plus fillers: ``rank_packs``), and every rank ends with the whole
    batch's logprobs and V_old, equal to one rank's."""
    from sonar.learner.batching import rank_packs
    from sonar.learner.critic import Critic
    from sonar.learner.train_step import batch_logprobs
    from tests.learner.test_train_step import tiny_model

    ranks = _two_ranks("gloo", tmp_path)
    model = tiny_model(0)
    batch = collate([t for g in groups(seed=3) for t in g], None, 0)
    one = batch_logprobs(model, batch, 0.7, 40, "cpu", 5)
    critic = Critic(CriticConfig(mode="head"), LearnerConfig(micro_batch_tokens=40), policy_module=model)
    with torch.no_grad():
        critic.head.weight.normal_(generator=torch.Generator().manual_seed(1))
    v_one = critic.predict(batch)
    assert float(one.abs().max()) > 0 and float(v_one.abs().max()) > 0
    lengths = batch.lengths.tolist()
    for r, res in enumerate(ranks):
        assert res["dp_sum"] == 1.0 + 2.0  # rank 0 adds 1, rank 1 adds 2
        assert torch.equal(res["rows"], torch.tensor([[1.0] * 3, [2.0] * 3]))
        assert res["object"] == {"groups": [1, 2]}
        mine = sum(len(rows) for rows, _ in rank_packs(lengths, 40, (r, 2)))
        assert res["logprob_rows"] == res["value_rows"] == mine < batch.size
        torch.testing.assert_close(res["logprobs"], one, rtol=0, atol=1e-6)
        torch.testing.assert_close(res["values"], v_one, rtol=0, atol=1e-6)
    real = [sum(len(rows) for rows, ok in rank_packs(lengths, 40, (r, 2)) if ok) for r in range(2)]
    assert sum(real) == batch.size  # every row forwarded once, by one rank


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
               "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send", "recv"}


def test_no_learner_module_issues_a_collective_outside_collectives_py():
    """Every learner-rank collective goes through ``learner/collectives.py`` (whose helpers need the device):
    a direct ``torch.distributed`` collective elsewhere would pick its tensor's device itself. (The old
    train_step, worker and checkpoint each had one.)"""
    found = []
    for path in sorted((ROOT / "learner").rglob("*.py")):
        if path.name == "collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
                owner = ast.unparse(node.func.value)
                if owner in ("dist", "torch.distributed", "torch.distributed.distributed_c10d"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner}.{node.func.attr}")
    assert not found, found


# -- a learner in this process ------------------------------------------------------------------------

def learner(policy_dir, *, zero=0, precision="fp32", algo="{kl_coef: 0.1}", extra=()):  # noqa: F811
    init_deepspeed()
    from sonar.learner.worker import Learner

    cfg = load_config([], [f"learner.zero_stage={zero}", f"learner.precision={precision}", "learner.warmup_steps=0",
                           "learner.micro_batch_tokens=40", "critic.warmup_steps=0", *extra,
                           f"stages=[{{kind: rl, steps: 4, lr: 0.001, algo: {algo}}}]"])
    return cfg, Learner(cfg, str(policy_dir))


def _batch():
    return collate([t for g in groups(seed=5) for t in g], None, 0)


def _partitioned(params) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list(params)
    return bool(params) and all(getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0
                                for p in params)


# -- the KL reference -----------------------------------------------------------------------------------

@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_kl_reference_is_a_copy_in_the_training_dtype(policy, precision, dtype):  # noqa: F811
    """Below ZeRO-3 the reference is a plain module holding exactly the policy's parameters at the stage's
    start, in the training dtype (bf16 on a bf16 run: half the old fp32 copy), frozen, and its logprobs are
    the policy's."""
    from deepspeed import DeepSpeedEngine

    from sonar.learner.train_step import batch_logprobs

    cfg, lrn = learner(policy, precision=precision)
    lrn.begin_stage(0, cfg.stages[0])
    ref = lrn.ref_module
    assert not isinstance(ref, DeepSpeedEngine)
    assert {p.dtype for p in ref.parameters()} == {dtype}
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    live = dict(lrn.engine.module.named_parameters())
    assert all(torch.equal(p, live[n]) for n, p in ref.named_parameters())
    batch = _batch()
    a = batch_logprobs(ref, batch, 0.7, 40, lrn.device, 5)
    b = batch_logprobs(lrn.engine.module, batch, 0.7, 40, lrn.device, 5)
    assert torch.equal(a, b) and float(a.abs().max()) > 0


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_under_zero3_the_kl_reference_is_a_partitioned_inference_engine(policy, precision, dtype):  # noqa: F811
    """ZeRO-3: the reference is a DeepSpeed engine without an optimizer (no gradients, master weights or
    Adam state), its parameters partitioned like the policy's (nothing held whole on this rank), in the
    training dtype; gathered, they are the policy's, and its logprobs are the policy's."""
    import deepspeed
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    from sonar.learner.train_step import batch_logprobs

    cfg, lrn = learner(policy, zero=3, precision=precision)
    lrn.begin_stage(0, cfg.stages[0])
    ref = lrn.ref_module
    assert isinstance(ref, DeepSpeedEngine) and isinstance(ref.optimizer, DeepSpeedZeRoOffload)
    params = list(ref.module.named_parameters())
    assert _partitioned(p for _, p in params)
    assert {p.dtype for _, p in params} == {dtype} and not any(p.requires_grad for _, p in params)
    full = lrn.named_tensors()
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        assert all(torch.equal(p, full[n]) for n, p in params)
    batch = _batch()
    a = batch_logprobs(ref, batch, 0.7, 40, lrn.device, 5)
    b = batch_logprobs(lrn.engine.module, batch, 0.7, 40, lrn.device, 5)
    assert torch.equal(a, b) and float(a.abs().max()) > 0


def test_no_forward_asks_for_or_returns_every_hidden_state():
    """The trained forward, the proximal and the reference forwards (chunked logits): none passes
    ``output_hidden_states=True`` (which makes the model collect and return every layer's output: L+1 tensors
    of [B, T, H], all alive until a no-grad forward returns) and none returns them; the chunked head reads
    the trunk's last hidden state, bit for bit what ``hidden_states[-1]`` was."""
    from sonar.learner.algo.chunked import chunked_logprobs
    from sonar.learner.train_step import TorchStepper, forward_logprobs, rl_step
    from tests.learner.test_chunked_logprobs import _llama, _qwen2

    model = _llama()
    ref = copy.deepcopy(model)
    seen = []
    for m in (model, ref):
        m.register_forward_pre_hook(lambda _m, _a, kw: seen.append(("asked", kw.get("output_hidden_states"))),
                                    with_kwargs=True)
        m.register_forward_hook(lambda _m, _a, _kw, out: seen.append(("returned", out.hidden_states)), with_kwargs=True)
    algo = AlgoConfig(ppo_epochs=2, off_policy="tis", kl_coef=0.1, kl_mode="loss")
    rl_step(TorchStepper(model, torch.optim.SGD(model.parameters(), lr=0.1), 0.0), groups(), [0, 0, 0], algo,
            LearnerConfig(micro_batch_tokens=40, logits_chunk_tokens=5), ReplayConfig(), 0.7, 0, ref_module=ref)
    assert len(seen) > 8  # trained, proximal and reference forwards all ran
    assert all(v in (None, False) for _, v in seen), [s for s in seen if s[1] not in (None, False)][:3]
    batch = _batch()
    for make in (_llama, _qwen2):
        m = make()
        with torch.no_grad():
            new = forward_logprobs(m, batch, 0.7, with_entropy=True, chunk_tokens=5)
            out = m(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                    output_hidden_states=True, logits_to_keep=torch.empty(0, dtype=torch.long))
            old = chunked_logprobs(out.hidden_states[-1], m.get_output_embeddings(), batch.input_ids, 0.7, 5,
                                   with_entropy=True)
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


# -- PPO's critic -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("zero, precision, mode", [(0, "fp32", "separate"), (3, "bf16", "separate"),
                                                   (0, "fp32", "head"), (3, "fp32", "head")])
def test_the_learners_critic_is_a_deepspeed_engine_like_the_policy(policy, zero, precision, mode):  # noqa: F811
    """Same ZeRO stage and precision as the policy, its own optimizer at ``critic.lr``; under ZeRO-3 the
    separate trunk is partitioned (never a whole fp32 copy on a rank)."""
    from deepspeed import DeepSpeedEngine

    cfg, lrn = learner(policy, zero=zero, precision=precision, algo="{name: ppo}", extra=(f"critic.mode={mode}",))
    critic = lrn.critic
    assert isinstance(critic.engine, DeepSpeedEngine) and critic.engine.zero_optimization_stage() == zero
    assert [g["lr"] for g in critic.optimizer.param_groups] == [cfg.critic.lr]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert {p.dtype for p in critic.model.parameters()} == {dtype}
    if mode == "separate":
        assert critic.model.trunk is not None and critic.trunk is critic.model.trunk
        assert _partitioned(critic.model.trunk.parameters()) == (zero == 3)
    else:  # the head alone trains; the trunk is the policy's
        assert critic.model.trunk is None and critic.trunk is lrn.engine.module.model
    stage = cfg.stages[0]
    lrn.begin_stage(0, stage)
    m = lrn.train_groups(groups(seed=1), [0] * 3, stage)
    assert m["learner/critic/value_loss"] > 0 and m["learner/critic/grad_norm"] > 0


def test_a_deepspeed_critic_takes_the_plain_critics_steps(policy):  # noqa: F811
    """The DeepSpeed critic (ZeRO-0, fp32, one rank) against the plain-PyTorch one from the same start: the
    same value losses and values after two steps (the second moves the trunk: at step 1 the zero head gives
    the trunk no gradient)."""
    from sonar.learner.critic import Critic, gae_advantages
    from sonar.learner.deepspeed_config import deepspeed_config

    init_deepspeed()
    lcfg = LearnerConfig(micro_batch_tokens=40, grad_clip=0.0)
    ccfg = CriticConfig(lr=1e-2, value_clip=0.0)
    plain = Critic(ccfg, lcfg, policy_dir=str(policy))
    ds = Critic(ccfg, lcfg, policy_dir=str(policy), ds_config=deepspeed_config(lcfg, on_gpu=False))
    assert ds.engine is not None and plain.engine is None
    batch = _batch()
    _, old, ret = gae_advantages(plain, batch, None, 0.0)
    trunk0 = {n: p.detach().clone() for n, p in ds.model.trunk.named_parameters()}
    for _ in range(2):
        a, b = plain.update(batch, old, ret), ds.update(batch, old, ret)
        assert b["learner/critic/value_loss"] == pytest.approx(a["learner/critic/value_loss"], rel=1e-5)
        assert b["learner/critic/grad_norm"] == pytest.approx(a["learner/critic/grad_norm"], rel=1e-4)
    torch.testing.assert_close(ds.predict(batch), plain.predict(batch), rtol=0, atol=1e-5)
    assert any(not torch.equal(trunk0[n], p) for n, p in ds.model.trunk.named_parameters())


# -- exports and checkpoints --------------------------------------------------------------------------------

@pytest.mark.parametrize("zero, precision", [(0, "fp32"), (0, "bf16"), (3, "bf16")])
def test_the_export_is_written_in_the_training_dtype(policy, tmp_path, monkeypatch, zero, precision):  # noqa: F811
    """``export_hf`` writes the weights in the training dtype (bf16 on a bf16 run; the old export was fp32)
    with the config saying so; they are the policy's parameters; under ZeRO-3 each gather holds one
    parameter (the full model is never gathered at once)."""
    import deepspeed
    from safetensors.torch import load_file

    from sonar.cluster.wire.policy import load_policy

    _, lrn = learner(policy, zero=zero, precision=precision, algo="{}")
    sizes = []
    real = deepspeed.zero.GatheredParameters

    class Counting(real):
        def __init__(self, params, *a, **k):
            sizes.append(len(params) if isinstance(params, (list, tuple)) else 1)
            super().__init__(params, *a, **k)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", Counting)
    lrn.export_hf(str(tmp_path / "out"))
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", real)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {dtype}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    full = lrn.named_tensors()
    assert set(saved) == set(full) and all(torch.equal(saved[n], full[n].to(dtype)) for n in saved)
    if zero == 3:
        assert sizes and max(sizes) == 1 and len(sizes) == len(full)
    else:
        assert sizes == []
    model, _ = load_policy(tmp_path / "out")  # reloads (widened to fp32 exactly)
    assert all(torch.equal(p, saved[n].float()) for n, p in model.named_parameters())


def test_the_rng_state_holds_cuda_exactly_when_cuda_is_present_and_an_old_one_restores(tmp_path):
    """``rng.pt`` gains the CUDA generators' states (``cuda``) when CUDA is available (here it is not: the
    key is absent); a checkpoint without it, as written before, restores the CPU generators."""
    from sonar.learner.checkpoint import load_checkpoint, rng_state, save_checkpoint
    from tests.learner.test_checkpoint import make_engine

    assert ("cuda" in rng_state()) == torch.cuda.is_available()
    engine = make_engine()
    torch.manual_seed(7)
    path = save_checkpoint(engine, tmp_path / "c", {"version": 1})
    expected = torch.rand(4)
    rng = torch.load(Path(path) / "rng.pt", weights_only=False)
    assert ("cuda" in rng) == torch.cuda.is_available()
    old = {k: rng[k] for k in ("torch", "numpy", "python")}  # the layout before CUDA states were saved
    torch.save(old, Path(path) / "rng.pt")
    torch.rand(10)
    load_checkpoint(make_engine(seed=1), path)
    assert torch.equal(torch.rand(4), expected)


# -- ZeRO-3 loading --------------------------------------------------------------------------------------------

def test_zero3_loading_builds_the_policy_in_its_partitions(policy):  # noqa: F811
    """Inside ``zero3_loading`` the policy is built in ``zero.Init`` and loaded into the partitions: every
    parameter is partitioned the moment the loader returns (no engine yet) and holds the checkpoint's
    values; afterwards transformers is back to plain loading and ``torch.nn.functional.linear`` is the stock
    one. Below ZeRO-3 it changes nothing."""
    import deepspeed
    from safetensors.torch import load_file
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from sonar.cluster.wire.policy import load_policy
    from sonar.learner.deepspeed_config import deepspeed_config, zero3_loading

    init_deepspeed()
    linear = torch.nn.functional.linear
    with zero3_loading(deepspeed_config(LearnerConfig(zero_stage=3), on_gpu=False)):
        assert is_deepspeed_zero3_enabled()
        model, _ = load_policy(policy)
    assert not is_deepspeed_zero3_enabled() and torch.nn.functional.linear is linear
    params = list(model.named_parameters())
    assert _partitioned(p for _, p in params)
    saved = load_file(Path(policy) / "model.safetensors")
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        assert all(torch.equal(p, saved[n]) for n, p in params)
    with zero3_loading(deepspeed_config(LearnerConfig(zero_stage=2), on_gpu=False)):
        plain, _ = load_policy(policy)
    assert not any(hasattr(p, "ds_id") for p in plain.parameters())


def test_the_zero3_learner_loads_its_policy_partitioned(policy, monkeypatch):  # noqa: F811
    """The learner's own load under ZeRO-3 returns a partitioned model (the old one returned the whole fp32
    model on every rank, partitioned only later by ``deepspeed.initialize``)."""
    import sonar.cluster.wire.policy as wire_policy

    real, seen = wire_policy.load_policy, []

    def spy(*args, **kwargs):
        model, tok = real(*args, **kwargs)
        seen.append(_partitioned(model.parameters()))
        return model, tok

    monkeypatch.setattr(wire_policy, "load_policy", spy)
    learner(policy, zero=3, algo="{}")
    assert seen == [True]
