"""Chunked token logprobs/entropy (learner/algo/chunked.py) equal the unchunked path, values and gradients,
and never hold more than one chunk of logits: in the autograd graph nor in the backward recomputation."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from sonar.cluster.wire.config import AlgoConfig, LearnerConfig, ReplayConfig
from sonar.learner.algo.chunked import chunked_logprobs
from sonar.learner.algo.losses import entropy_from_logits, token_logprobs
from sonar.learner.batching import collate
from sonar.learner.train_step import TorchStepper, forward_logprobs, rl_step, sft_step
from tests.learner.test_train_step import VOCAB, groups, init_deepspeed, keep_grads_before_step

ATOL = 1e-6
"""fp32 tolerance, scaled by max(1, the largest reference magnitude): a chunk's matmul may sum in another
order than the whole batch's (one-row chunks take a matrix-vector kernel), a few ulp of the logits."""


def close(x, ref, msg=""):
    torch.testing.assert_close(x, ref, rtol=0, atol=ATOL * max(1.0, float(ref.abs().max())), msg=msg or None)


def _head_and_hidden(seed=0, b=3, t=11, h=8, v=29):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(h, v, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
        head.bias.copy_(torch.randn(v, generator=g))
    hidden = torch.randn(b, t, h, generator=g, requires_grad=True)
    ids = torch.randint(0, v, (b, t), generator=g)
    return head, hidden, ids


@pytest.mark.parametrize("chunk", [1, 4, 7, 30, 1000])  # 3 rows x 10 positions: 4 and 7 leave a short last chunk
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_unchunked_values_and_gradients(chunk, temperature):
    """Logprobs and entropy, and the gradients of hidden states, head weight and bias through both."""
    head, hidden, ids = _head_and_hidden()
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)  # arbitrary upstream grads

    def run(fn):
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        lp, ent = fn()
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return lp.detach(), ent.detach(), [x.grad.clone() for x in (hidden, head.weight, head.bias)]

    def ref():
        logits = head(hidden)
        return token_logprobs(logits, ids, temperature), entropy_from_logits(logits, temperature)

    a = run(ref)
    b = run(lambda: chunked_logprobs(hidden, head, ids, temperature, chunk, with_entropy=True, entropy_grad=True))
    close(b[0], a[0])
    close(b[1], a[1])
    for x, y, name in zip(b[2], a[2], ("hidden", "weight", "bias")):
        close(x, y, name)


def test_entropy_without_grad_is_a_metric():
    head, hidden, ids = _head_and_hidden()
    lp, ent = chunked_logprobs(hidden, head, ids, 0.7, 4, with_entropy=True)
    assert lp.requires_grad and not ent.requires_grad
    close(ent, entropy_from_logits(head(hidden), 0.7).detach())
    assert chunked_logprobs(hidden, head, ids, 1.0, 4)[1] is None
    with pytest.raises(ValueError, match="logits_chunk_tokens=0"):
        chunked_logprobs(hidden, head, ids, 1.0, 0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, head, ids, 0.0, 4)


def test_graph_keeps_no_logits_and_backward_recomputes_chunk_by_chunk():
    """Saved tensors: nothing of the vocabulary's size times more than one chunk; the unchunked path
    saves [N, V]. The head runs once per chunk in the forward and once per chunk in the backward, each
    call on at most ``chunk`` tokens."""
    v, chunk = 257, 4
    head, hidden, ids = _head_and_hidden(b=2, t=16, h=8, v=v)
    n = 2 * 15
    calls: list[int] = []
    handle = head.register_forward_hook(lambda m, i, o: calls.append(o.shape[0] if o.dim() == 2 else -1))
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = chunked_logprobs(hidden, head, ids, 0.7, chunk, with_entropy=True, entropy_grad=True)
    n_chunks = -(-n // chunk)
    assert calls == [chunk] * (n_chunks - 1) + [n - chunk * (n_chunks - 1)]
    assert max(saved) < chunk * v, f"a saved tensor of {max(saved)} elements: logits kept for backward"
    (lp.sum() + ent.sum()).backward()
    assert len(calls) == 2 * n_chunks and max(calls) <= chunk  # recomputed, one chunk at a time
    handle.remove()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(head(hidden), ids, 0.7)
    assert max(saved) >= n * v  # the unchunked path does keep them: the check above can fail


def _llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True)).float()


def _qwen2(seed=0):  # untied head, attention biases: the architecture of the 151,936-token models
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                        tie_word_embeddings=False)).float()


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama_tied", "qwen2_untied"])
def test_forward_logprobs_chunked_equals_unchunked(make):
    """Through the model: padded rows (attention mask), temperature 0.7, a chunk that divides nothing."""
    model = make()
    batch = collate([t for g in groups() for t in g], None, 0)
    assert batch.attention_mask.min() == 0  # rows of different lengths: padding present
    with torch.no_grad():
        a = forward_logprobs(model, batch, 0.7, with_entropy=True)
        b = forward_logprobs(model, batch, 0.7, with_entropy=True, chunk_tokens=7)
    close(b[0], a[0])
    close(b[1], a[1])


def _step(make, chunk, kind, **algo):
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    lcfg = LearnerConfig(micro_batch_tokens=40, logits_chunk_tokens=chunk)
    stepper, grads = keep_grads_before_step(TorchStepper(model, opt, 0.0), lambda p: p.grad)
    if kind == "rl":
        m = rl_step(stepper, groups(), [0, 0, 0], AlgoConfig(**algo), lcfg, ReplayConfig(), 0.7, 0)
    else:
        m = sft_step(stepper, [t for g in groups() for t in g], lcfg, 0)
    return m, dict(zip([n for n, _ in model.named_parameters()], grads, strict=True))


@pytest.mark.parametrize("make", [_llama, _qwen2], ids=["llama_tied", "qwen2_untied"])
@pytest.mark.parametrize("kind", ["rl", "sft"])
def test_train_step_loss_and_every_gradient_equal(make, kind):
    """The loss (masked: prompt, retrieval and padding carry none) and the gradient of every parameter."""
    a, ga = _step(make, 0, kind)
    b, gb = _step(make, 5, kind)
    assert a["learner/micro_batches"] > 1
    assert b["learner/loss"] == pytest.approx(a["learner/loss"], abs=ATOL)
    if kind == "rl":
        assert b["learner/entropy"] == pytest.approx(a["learner/entropy"], abs=ATOL)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert float(ga[n].abs().max()) > 0, n
        close(gb[n], ga[n], n)


def test_kl_reference_and_proximal_logprobs_chunked():
    """The no-grad paths (proximal logprobs for 2 epochs, the reference policy's KL) chunk too."""
    algo = dict(ppo_epochs=2, off_policy="tis", kl_coef=0.1, kl_mode="loss")

    def run(chunk):
        model = _llama()
        ref = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        lcfg = LearnerConfig(micro_batch_tokens=40, logits_chunk_tokens=chunk)
        m = rl_step(TorchStepper(model, opt, 0.0), groups(), [0, 0, 0], AlgoConfig(**algo), lcfg, ReplayConfig(),
                    0.7, 0, ref_module=ref)
        return m, [p.detach().clone() for p in model.parameters()]

    (a, pa), (b, pb) = run(0), run(3)
    assert b["learner/loss"] == pytest.approx(a["learner/loss"], abs=ATOL)
    for x, y in zip(pb, pa, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_deepspeed_zero3_chunked_equals_plain_unchunked():
    """ZeRO-3 partitions the head's weight: calling the head module per chunk (and again in the backward
    recomputation) must gather it each time. Same accumulated gradients as plain PyTorch, unchunked."""
    ds = init_deepspeed()
    from deepspeed.utils import safe_get_full_grad
    from sonar.learner.deepspeed_config import deepspeed_config
    from tests.learner.test_train_step import GRAD_ATOL_OF_MAX

    ref = _llama()
    model = copy.deepcopy(ref)
    lcfg = LearnerConfig(zero_stage=3, micro_batch_tokens=40, logits_chunk_tokens=6, grad_clip=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # ZeRO accepts AdamW; the gradients are compared
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=deepspeed_config(lcfg, on_gpu=False))
    from sonar.learner.train_step import DeepSpeedStepper

    ds_stepper, ds_grads = keep_grads_before_step(DeepSpeedStepper(engine, 3), safe_get_full_grad)
    b = rl_step(ds_stepper, groups(), [0, 0, 0], AlgoConfig(), lcfg, ReplayConfig(), 0.7, 0)
    a, ga = _step(_llama, 0, "rl")
    assert b["learner/loss"] == pytest.approx(a["learner/loss"], abs=1e-6)
    for (n, g), h in zip(ga.items(), ds_grads, strict=True):
        torch.testing.assert_close(h, g, rtol=0, atol=GRAD_ATOL_OF_MAX * float(g.abs().max()), msg=n)
