"""GPU device check (issues 12, 21, 51 and 56): ten checks in under 10 minutes on one GPU, torch (and, for the
last two, carried wheels) only.

    python bench/gpu_check.py --out $OUT/gpu.json [--wheels .gpu_wheels]     # from the repository root

Needs torch; transformers is used when present (a Qwen2-shaped model), else a plain torch decoder stand-in.
Checks 1-7 import no Sonar module that needs Ray, DeepSpeed or MLflow: Sonar's weight broadcast
(``cluster/transport/weights.py``), chunked logprobs (``learner/algo/chunked.py``) and the learner's collectives
(``learner/collectives.py``) import only torch and are loaded by file path.

1. ``nccl_broadcast``: Sonar's ``BroadcastGroup`` with the NCCL backend (``ProcessGroupNCCL(store, rank,
   size, options)`` with the group's timeout), world of one, created under a deadline; then its streamed
   send path for a 0.5B-parameter bf16 state shaped like Qwen2.5-0.5B. Figure: GB/s of the send path.
2. ``learner_step``: a bf16 learner step at vocabulary 151,936, unchunked against chunked logits
   (``chunked_logprobs``): tokens/s and ``torch.cuda.max_memory_allocated`` of each.
3. ``cuda_ipc``: a 0.5B bf16 state handed to a second process on the same GPU through CUDA IPC.
4. ``dp_sum_nccl``: under a real NCCL default group, a CPU-tensor all-reduce is refused (what crashed 2+
   learner ranks at their first step) and ``learner/collectives.py``'s helpers work on the GPU.
5. ``push_memory_and_timing``: ``send_weights`` holds two bucket buffers on the GPU whatever the model size
   (peak allocation beside the weights), and returns after the transfer completed (its call time against
   the time to a ``torch.cuda.synchronize`` after it).
6. ``checksum_memory``: ``weights.checksum`` of a tensor shaped like Qwen2.5-7B's embedding allocates one
   float64 chunk, not a float64 copy of the tensor (4.1 GiB), and gives the same value.
7. ``nograd_forward_memory``: a no-grad forward of a 1.5B Qwen2 shape at 32k tokens keeping every hidden
   state against the trunk's last hidden state only (the learner's path): peak memory of each.
8. ``colocated_handover``: colocated placement's hand-over (``cluster/transport/handover.py``, ``cuda_ipc``): a
   0.5B bf16 state pushed by Sonar's bucketed push into a second process on the same GPU through one CUDA
   IPC segment (no NCCL): GB/s, checksums, the sender's memory beside the weights against the plan (the
   push's two stream buffers and a segment of the largest bucket).
9. ``zero2_rl_step``: one ZeRO-2 bf16 ``rl_step`` of Sonar's learner on a random Qwen2.5-1.5B at 32k tokens:
   peak memory against the memory plan (``cluster/wire/memory.py``); then DeepSpeed's ``offload_states`` as
   ``learner.offload_while_generating`` calls it (memory freed against 12 bytes per parameter, and back). Needs DeepSpeed and omegaconf, which the
   check machine lacks: ``bench/gpu_wheels.sh`` downloads them (about 6 MB) into ``.gpu_wheels/`` to carry.
10. ``zero2_lora_rl_step``: the same step of a LoRA learner (``learner.lora.rank=16``: the base frozen, the
   adapters trained) against the plan's LoRA rows; needs peft too (carried).

Each check prints ``PASS``/``FAIL``/``SKIP`` with its figure; ``--out`` gets one JSON with every check, the
device, torch and CUDA versions. Without CUDA every check is ``SKIP`` and the script exits 0; ``--cpu-smoke``
runs every check's code on CPU at toy sizes (gloo; ``"cuda:gloo"`` for check 4), for CI.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB = 151_936
QWEN05B = {"vocab": VOCAB, "hidden": 896, "layers": 24, "intermediate": 4864, "kv": 128}
"""Qwen2.5-0.5B's tensor shapes (494M parameters, tied embeddings)."""


TORCH_ONLY_PACKAGE = ("sonar", "sonar.cluster", "sonar.cluster.wire", "sonar.cluster.wire.buckets")
"""The Sonar modules a check may import as a package: the bucket plan the transport's ``weights.py`` imports
(pure, torch only) and the packages above it, which do nothing at import."""


def checkout_importable() -> None:
    """Where ``sonar`` is not installed (the device machine has torch only), make this checkout importable as
    it: a link named ``sonar`` to the repository root, first on ``sys.path`` (``pyproject.toml`` maps the
    package to the root the same way). Only ``TORCH_ONLY_PACKAGE`` is imported through it."""
    if importlib.util.find_spec("sonar") is not None:
        return
    import tempfile

    d = tempfile.mkdtemp(prefix="sonar-checkout-")
    os.symlink(REPO, os.path.join(d, "sonar"))
    sys.path.insert(0, d)


def load_by_path(name: str, rel: str):
    """A Sonar module that imports only torch (and the bucket plan, ``TORCH_ONLY_PACKAGE``), loaded from its
    file: the installed package or none."""
    checkout_importable()
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def with_deadline(fn, timeout_s: float, what: str):
    """Run ``fn`` in a daemon thread; raise TimeoutError naming ``what`` if it has not returned in time."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def sync(torch):
    if torch.cuda.is_available() and DEVICE == "cuda":
        torch.cuda.synchronize()


DEVICE = "cuda"
"""``--cpu-smoke`` sets "cpu": every check's code path on CPU at toy sizes (gloo instead of NCCL), for CI."""


def qwen05b_state(torch, device, dtype, layers: int = QWEN05B["layers"], vocab: int = VOCAB):
    """Named tensors with Qwen2.5-0.5B's shapes (random values); fewer layers / a smaller vocabulary for
    the CPU smoke run."""
    c = {**QWEN05B, "layers": layers, "vocab": vocab}
    h, i, kv = c["hidden"], c["intermediate"], c["kv"]
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"model.embed_tokens.weight": (c["vocab"], h), "model.norm.weight": (h,)}
    for layer in range(c["layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h),
                       p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    return {n: torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype) for n, s in shapes.items()}


# ------------------------------------------------------------------------------------------------ 1
def check_nccl_broadcast(torch, args) -> dict:
    W = load_by_path("sonar_wire_weights", "cluster/transport/weights.py")
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    t0 = time.perf_counter()

    def create():
        store = W.open_store("127.0.0.1", 1, timeout_s=args.group_timeout_s)
        grp = W.BroadcastGroup("127.0.0.1", store.port, 0, 1, backend=backend, timeout_s=args.group_timeout_s,
                               store=store)
        probe = torch.ones(1024, device=DEVICE)
        grp.broadcast(probe, 0)  # NCCL builds its communicator lazily: the first collective
        sync(torch)
        return grp

    grp = with_deadline(create, args.group_timeout_s, f"{backend} broadcast group creation")
    create_s = time.perf_counter() - t0
    state = qwen05b_state(torch, DEVICE, torch.bfloat16, args.state_layers, args.vocab)
    specs = [W.TensorSpec(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    buckets = W.plan_buckets(specs)
    params = sum(s.numel for s in specs)
    times, sent = [], 0
    for _ in range(args.repeats + 1):  # the first push allocates the reused bucket buffers: untimed
        sync(torch)
        t = time.perf_counter()
        sent = with_deadline(lambda: grp.send_weights(buckets, state), args.group_timeout_s, "send_weights")
        sync(torch)
        times.append(time.perf_counter() - t)
    best = min(times[1:])
    opts = getattr(getattr(grp._pg, "options", None), "_timeout", None)  # NCCL: timeout_s + the watchdog margin
    push = dict(getattr(grp, "last_push", {}))
    grp.close()
    gbps = sent / best / 1e9
    return {"status": "PASS", "figure": f"{gbps:.1f} GB/s send path", "gb_per_s": gbps, "params": params,
            "bytes": sent, "buckets": len(buckets), "send_s": times[1:], "group_create_s": create_s,
            "group_option_timeout_s": opts.total_seconds() if opts is not None else None, "last_push": push,
            "backend": backend, "world_size": 1, "note": "world of one: the broadcast moves no bytes between GPUs; the figure is "
                                     "the send path (bucket flatten + collective call) on the device"}


# ------------------------------------------------------------------------------------------------ 2
def build_model(torch, args):
    """(trunk(ids) -> final hidden states, head module, params, kind): transformers' Qwen2 if available."""
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except Exception:  # noqa: BLE001 - transformers missing or broken: the plain stand-in
        Qwen2ForCausalLM = None
    torch.manual_seed(0)
    if Qwen2ForCausalLM is not None:
        cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                          num_key_value_heads=max(1, args.hidden // 448), max_position_embeddings=4096,
                          tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg).to(DEVICE, torch.bfloat16)
        model.train()

        def trunk(ids):
            return model.model(input_ids=ids, use_cache=False).last_hidden_state

        return trunk, model.lm_head, list(model.parameters()), "transformers Qwen2ForCausalLM"
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.norm, self.mlp = nn.LayerNorm(h), nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    emb = nn.Embedding(args.vocab, args.hidden)
    blocks = nn.Sequential(*[Block(args.hidden) for _ in range(args.layers)], nn.LayerNorm(args.hidden))
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    head.weight = emb.weight
    mods = nn.ModuleList([emb, blocks, head]).to(DEVICE, torch.bfloat16)
    return (lambda ids: blocks(emb(ids))), head, list(mods.parameters()), "plain torch MLP decoder (no transformers)"


def check_learner_step(torch, args) -> dict:
    C = load_by_path("sonar_learner_chunked", "learner/algo/chunked.py")
    trunk, head, params, kind = build_model(torch, args)
    opt = torch.optim.AdamW(params, lr=1e-6)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq_len), device=DEVICE, generator=g)
    mask = (torch.rand(args.rows, args.seq_len - 1, device=DEVICE, generator=g) > 0.3).float()
    adv = torch.randn(args.rows, 1, device=DEVICE, generator=g).expand(-1, args.seq_len - 1)
    tokens = args.rows * args.seq_len

    def loss_of(chunk):
        hidden = trunk(ids)
        if chunk:
            lp, ent = C.chunked_logprobs(hidden, head, ids, 1.0, chunk, with_entropy=True)
        else:
            z = head(hidden)[:, :-1].float()
            lp = C.scaled_logprobs(z, ids[:, 1:])
            with torch.no_grad():
                ent = C.scaled_entropy(z)
        return -(adv * lp * mask).sum() / mask.sum(), float((ent * mask).sum() / mask.sum())

    cuda = DEVICE == "cuda"
    out = {"model": kind, "vocab": args.vocab, "rows": args.rows, "seq_len": args.seq_len, "tokens_per_step": tokens,
           "params": sum(p.numel() for p in params), "unchunked_fp32_logits_gib": tokens * args.vocab * 4 / 2**30}
    losses = {}
    for label, chunk in (("unchunked", 0), ("chunked", args.chunk)):
        try:
            for p in params:  # the same starting point for both: no update (lr applies, but compare loss at step 0)
                p.grad = None
            sync(torch)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            times = []
            for i in range(args.steps + 1):
                sync(torch)
                t = time.perf_counter()
                loss, ent = loss_of(chunk)
                if i == 0:
                    losses[label] = (float(loss.detach()), ent)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync(torch)
                times.append(time.perf_counter() - t)
            best = min(times[1:])
            out[label] = {"chunk_tokens": chunk, "tokens_per_s": tokens / best, "step_s": times[1:],
                          "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None}
        except torch.cuda.OutOfMemoryError as e:
            out[label] = {"chunk_tokens": chunk, "error": f"OOM: {str(e).splitlines()[0]}"}
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        # the optimizer moved the weights: rebuild the same model for the next variant
        del opt
        trunk, head, params, kind = build_model(torch, args)
        opt = torch.optim.AdamW(params, lr=1e-6)
    u, c = out["unchunked"], out["chunked"]
    if "error" in c:
        return {**out, "status": "FAIL", "figure": c["error"]}
    def fig(r):
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB"
        return f"{r['tokens_per_s']:.0f} tok/s, peak {peak}"

    figure = f"chunked {fig(c)}; unchunked " + (u["error"] if "error" in u else fig(u))
    ok = True
    if "error" not in u:
        lu, lc = losses["unchunked"][0], losses["chunked"][0]
        out["loss_unchunked"], out["loss_chunked"] = lu, lc
        out["entropy_unchunked"], out["entropy_chunked"] = losses["unchunked"][1], losses["chunked"][1]
        # bf16 logits from differently shaped matmuls: agree to bf16 precision, not bitwise
        ok = abs(lu - lc) <= 2e-2 * max(1.0, abs(lu)) and (not cuda or c["peak_gib"] < u["peak_gib"])
    return {**out, "status": "PASS" if ok else "FAIL", "figure": figure}


# ------------------------------------------------------------------------------------------------ 3
def _ipc_receiver(q_in, q_out, n_repeats, device):
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
    mine = None
    for _ in range(n_repeats):
        t_put, shared = q_in.get()
        if mine is None:
            mine = torch.empty_like(shared)
        mine.copy_(shared)
        if device == "cuda":
            torch.cuda.synchronize()
        t_done = time.monotonic()
        checksum = float(mine[:: max(1, mine.numel() // 1_000_000)].float().sum())
        del shared  # release the producer's memory handle before it is reused
        q_out.put((t_put, t_done, checksum))


def check_cuda_ipc(torch, args) -> dict:
    import torch.multiprocessing as mp

    state = qwen05b_state(torch, DEVICE, torch.bfloat16, args.state_layers, args.vocab)
    flat = torch.cat([t.reshape(-1) for t in state.values()])  # one flat buffer: one IPC handle
    del state
    nbytes = flat.numel() * flat.element_size()
    want = float(flat[:: max(1, flat.numel() // 1_000_000)].float().sum())
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_ipc_receiver, args=(q_in, q_out, args.repeats + 1, DEVICE), daemon=True)
    proc.start()
    times = []
    try:
        for _ in range(args.repeats + 1):  # the first hand-off maps the handle and allocates: untimed
            sync(torch)
            q_in.put((time.monotonic(), flat))
            t_put, t_done, got = q_out.get(timeout=args.group_timeout_s)
            times.append(t_done - t_put)
            if abs(got - want) > 1e-3 * max(1.0, abs(want)):
                return {"status": "FAIL", "figure": f"checksum {got} != {want}", "bytes": nbytes}
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    best = min(times[1:])
    gbps = nbytes / best / 1e9
    return {"status": "PASS", "figure": f"{gbps:.1f} GB/s hand-off + copy", "gb_per_s": gbps, "bytes": nbytes,
            "params": flat.numel(), "handoff_s": times[1:], "first_handoff_s": times[0]}


# ------------------------------------------------------------------------------------------------ 4
def check_dp_sum_nccl(torch, args) -> dict:
    """The learner ranks' collectives (``learner/collectives.py``) under a real NCCL group: a CPU tensor
    is refused (what broke 2+ ranks at the first step), the helpers' device tensors pass. World of one:
    the device check happens before any communication, so one GPU shows it."""
    import datetime

    import torch.distributed as dist

    Co = load_by_path("sonar_learner_collectives", "learner/collectives.py")
    W = load_by_path("sonar_wire_weights", "cluster/transport/weights.py")
    backend = "nccl" if DEVICE == "cuda" else "cuda:gloo"  # on CPU: the stand-in that refuses CPU tensors
    store = W.master_store("127.0.0.1", 0, 1, args.group_timeout_s)
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=args.group_timeout_s))
    try:
        try:
            dist.all_reduce(torch.tensor([1.0], dtype=torch.float64))
            cpu_refused, cpu_error = False, None
        except (RuntimeError, ValueError) as e:
            cpu_refused, cpu_error = True, str(e).splitlines()[0]
        if DEVICE != "cuda":  # no device to put the helpers' tensors on: the refusal is what CPU can show
            return {"status": "PASS" if cpu_refused else "FAIL", "figure": f"cpu tensor refused: {cpu_refused}",
                    "backend": backend, "cpu_error": cpu_error}
        dev = torch.device("cuda", torch.cuda.current_device())
        total = Co.dp_sum(2.5, (0, 2), dev)  # dp world 2 forces the collective; the group has one rank
        obj = Co.broadcast_object({"groups": [1, 2]}, 0, (0, 2), dev)
        rows = Co.sum_disjoint_rows_(torch.ones(4, 3, device=dev), (0, 2))
        Co.barrier((0, 2), dev)
        ok = cpu_refused and total == 2.5 and obj == {"groups": [1, 2]} and float(rows.sum()) == 12.0
        return {"status": "PASS" if ok else "FAIL", "backend": backend, "cpu_error": cpu_error,
                "figure": f"cpu tensor refused: {cpu_refused}; dp_sum/broadcast_object/rows/barrier on {dev}: ok"}
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ 5
def check_push_memory_and_timing(torch, args) -> dict:
    """The streamed push (``BroadcastGroup.send_weights``): its device buffers are two buckets whatever the
    model size, and the call returns after the transfer completed (``last_push['seconds']`` against the
    wall time of the call between two synchronises)."""
    W = load_by_path("sonar_wire_weights", "cluster/transport/weights.py")
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    store = W.open_store("127.0.0.1", 1, timeout_s=args.group_timeout_s)
    grp = with_deadline(lambda: W.BroadcastGroup("127.0.0.1", store.port, 0, 1, backend=backend,
                                                 timeout_s=args.group_timeout_s, store=store),
                        args.group_timeout_s, f"{backend} group")
    state = qwen05b_state(torch, DEVICE, torch.bfloat16, args.state_layers, args.vocab)
    specs = [W.TensorSpec(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    buckets = W.plan_buckets(specs)
    model_bytes = sum(b.nbytes for b in buckets)
    cuda = DEVICE == "cuda"
    sync(torch)
    before = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for _ in range(args.repeats + 1):
        sync(torch)
        t = time.perf_counter()
        grp.send_weights(buckets, state)  # no sync of ours in between: the call must include completion
        call_s = time.perf_counter() - t
        sync(torch)
        rows.append({"call_s": call_s, "reported_s": grp.last_push["seconds"], "synced_s": time.perf_counter() - t})
    peak_extra = (torch.cuda.max_memory_allocated() - before) if cuda else grp.buffer_bytes()
    grp.close()
    two = 2 * max(b.nbytes for b in buckets)
    timed = rows[1:]
    # call time within 10 % of the synchronised time: nothing left in flight when send_weights returns
    completes = all(r["call_s"] >= 0.9 * r["synced_s"] for r in timed)
    ok = completes and peak_extra <= two + (64 << 20)
    return {"status": "PASS" if ok else "FAIL", "model_bytes": model_bytes, "buckets": len(buckets),
            "two_buckets_bytes": two, "peak_extra_bytes": peak_extra, "pushes": timed,
            "figure": f"extra {peak_extra / 2**20:.0f} MiB for a {model_bytes / 2**30:.2f} GiB model "
                      f"(two buckets {two / 2**20:.0f} MiB); call includes completion: {completes}"}


# ------------------------------------------------------------------------------------------------ 6
def check_checksum_memory(torch, args) -> dict:
    """``weights.checksum`` on a tensor shaped like Qwen2.5-7B's embedding ([152,064, 3,584] bf16, 1.0 GiB):
    its temporary is one float64 chunk, where the old whole-tensor ``double()`` took 4.1 GiB."""
    W = load_by_path("sonar_wire_weights", "cluster/transport/weights.py")
    rows, cols = (152_064, 3_584) if DEVICE == "cuda" else (4_096, 64)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    t = torch.randn(rows, cols, generator=g, device=DEVICE, dtype=torch.float32).to(torch.bfloat16)
    cuda = DEVICE == "cuda"
    sync(torch)
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    got = W.checksum([("model.embed_tokens.weight", t)])
    sync(torch)
    peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
    full = float(t.double().abs().sum())  # the old way, for the value (and its cost)
    w = (int(__import__("hashlib").md5(b"model.embed_tokens.weight").hexdigest()[:6], 16) % 997) + 1
    same = abs(got - w * full) <= 1e-9 * abs(w * full)
    ok = same and (peak is None or peak <= 2 * W.CHECKSUM_CHUNK_BYTES + (16 << 20))
    return {"status": "PASS" if ok else "FAIL", "tensor_bytes": t.numel() * 2, "peak_extra_bytes": peak,
            "old_float64_copy_bytes": t.numel() * 8, "chunk_bytes": W.CHECKSUM_CHUNK_BYTES, "equal": same,
            "figure": f"peak {'n/a' if peak is None else f'{peak / 2**20:.0f} MiB'} vs "
                      f"{t.numel() * 8 / 2**30:.1f} GiB for a float64 copy; value equal: {same}"}


# ------------------------------------------------------------------------------------------------ 7
def check_nograd_forward_memory(torch, args) -> dict:
    """A no-grad forward (the proximal / reference logprobs) with ``output_hidden_states=True`` (every
    layer's output kept: layers+1 x tokens x hidden) against the trunk's last hidden state only (the
    learner's path now), on a Qwen2 shape: peak memory of each."""
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except Exception as e:  # noqa: BLE001
        return {"status": "SKIP", "figure": f"transformers unavailable ({type(e).__name__})"}
    cuda = DEVICE == "cuda"
    hidden, layers, tokens = (1536, 28, 32_768) if cuda else (64, 2, 256)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 768),
                      max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(DEVICE, torch.bfloat16).eval()
    rows = max(1, tokens // 4096) if cuda else 2
    ids = torch.randint(0, args.vocab, (rows, tokens // rows), device=DEVICE)
    out = {}
    for label in ("all_hidden_states", "trunk_last_hidden"):
        sync(torch)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        with torch.no_grad():
            if label == "all_hidden_states":
                h = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states[-1]
            else:
                h = model.model(input_ids=ids, use_cache=False).last_hidden_state
            last = h[:, -1].float().sum().item()
            del h
        sync(torch)
        out[label] = {"peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None,
                      "last_sum": last}
    a, b = out["all_hidden_states"], out["trunk_last_hidden"]
    same = abs(a["last_sum"] - b["last_sum"]) <= 1e-2 * max(1.0, abs(a["last_sum"]))
    ok = same and (not cuda or b["peak_extra_gib"] < a["peak_extra_gib"])
    fig = ("n/a on CPU" if not cuda else f"{b['peak_extra_gib']:.2f} GiB (trunk) vs {a['peak_extra_gib']:.2f} GiB "
           f"(all hidden states)")
    return {"status": "PASS" if ok else "FAIL", "hidden": hidden, "layers": layers, "tokens": rows * (tokens // rows),
            **out, "figure": f"{fig}; same last hidden state: {same}"}


# ------------------------------------------------------------------------------------------------ 9
def _handover_receiver(port, name, n_pushes, device, specs, timeout_s, q_out):
    import torch

    if device == "cuda":
        torch.cuda.set_device(0)
    W = load_by_path("sonar_wire_weights", "cluster/transport/weights.py")
    H = load_by_path("sonar_wire_handover", "cluster/transport/handover.py")
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    pg = H.HandoverCollective(dist.PrefixStore(name, store), 1, 2, name, dev)
    grp = W.BroadcastGroup.over(pg, 1, 2, dev, timeout_s)
    buckets = W.plan_buckets([W.TensorSpec(n, tuple(sh), getattr(torch, d)) for n, sh, d in specs])
    mine = {n: torch.empty(tuple(sh), dtype=getattr(torch, d), device=device) for n, sh, d in specs}
    for _ in range(n_pushes):
        sums = W.Checksum()
        grp.recv_streamed(buckets, lambda named: [mine[k].copy_(v) for k, v in named], sums)
        q_out.put((dict(grp.last_push), sums.value))
    grp.close()


def check_colocated_handover(torch, args) -> dict:
    """Colocated placement's hand-over (``cluster/transport/handover.py``, backend ``cuda_ipc``): Sonar's bucketed
    push from this process (the learner) into a second process on the same GPU (an engine), through one CUDA
    IPC segment of the largest bucket's size and the store's events, no NCCL. Figures: GB/s of the push
    (copy in, IPC, copy out), the receiver's checksum against the sender's, and the sender's peak memory
    beside the weights (one segment: the largest bucket). ``--cpu-smoke``: the ``shm`` backend (a /dev/shm
    segment) on the same path."""
    import torch.multiprocessing as mp
    import torch.distributed as dist

    W = load_by_path("sonar_wire_weights", "cluster/transport/weights.py")
    H = load_by_path("sonar_wire_handover", "cluster/transport/handover.py")
    state = qwen05b_state(torch, DEVICE, torch.bfloat16, args.state_layers, args.vocab)
    specs = [W.TensorSpec(n, tuple(t.shape), t.dtype) for n, t in state.items()]
    buckets = W.plan_buckets(specs)
    want = W.checksum(state.items())
    store = W.open_store("127.0.0.1", 2, timeout_s=args.group_timeout_s)
    name = f"sonar-gpucheck-{store.port}"
    ctx = mp.get_context("spawn")
    q_out = ctx.Queue()
    wire = [(sp.name, list(sp.shape), str(sp.dtype).removeprefix("torch.")) for sp in specs]
    proc = ctx.Process(target=_handover_receiver, args=(store.port, name, args.repeats + 1, DEVICE, wire,
                                                        args.group_timeout_s, q_out), daemon=True)
    proc.start()
    # the device with its index, as BroadcastGroup itself resolves it: a parameter on cuda:0 is sent in place
    # only if it is on the group's device (torch.device("cuda") != torch.device("cuda", 0))
    dev = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    pg = H.HandoverCollective(dist.PrefixStore(name, store), 0, 2, name, dev)
    grp = W.BroadcastGroup.over(pg, 0, 2, dev, args.group_timeout_s)
    times, sums = [], []
    try:
        sync(torch)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for _ in range(args.repeats + 1):  # the first push creates the segment and the receiver maps it: untimed
            t = time.perf_counter()
            sent = with_deadline(lambda: grp.send_weights(buckets, state), args.group_timeout_s, "hand-over push")
            pushed, got = q_out.get(timeout=args.group_timeout_s)
            times.append(time.perf_counter() - t)
            sums.append(got)
        peak_extra = (torch.cuda.max_memory_allocated() - base) / 2**30 if DEVICE == "cuda" else None
    finally:
        grp.close()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    best = min(times[1:])
    largest = max(b.nbytes for b in buckets) / 2**30
    # what the sender holds beside the weights, as the memory plan counts it: the push's two stream buffers
    # (multi-tensor buckets are flattened there first) and the IPC segment (one largest bucket)
    planned = (W.send_buffer_bytes(buckets) + max(b.nbytes for b in buckets)) / 2**30
    equal = all(abs(g - want) <= 1e-9 * abs(want) for g in sums)
    ok = equal and (peak_extra is None or peak_extra <= planned + 0.05)
    gbps = sent / best / 1e9
    return {"status": "PASS" if ok else "FAIL", "bytes": sent, "gb_per_s": gbps, "push_s": times[1:],
            "first_push_s": times[0], "checksums_equal": equal, "sender_peak_extra_gib": peak_extra,
            "largest_bucket_gib": largest, "planned_extra_gib": planned,
            "backend": "cuda_ipc" if DEVICE == "cuda" else "shm",
            "figure": f"{gbps:.1f} GB/s push into a second process on the device, checksums "
                      f"{'equal' if equal else 'DIFFER'}, sender +{peak_extra if peak_extra is None else round(peak_extra, 2)} "
                      f"GiB (planned {planned:.2f}: two stream buffers and a segment of the largest bucket, "
                      f"{largest:.2f} GiB)"}


# ------------------------------------------------------------------------------------------------ 8
def import_sonar(args):
    """``sonar`` importable on a machine where it is not installed: a temporary folder holding a link named
    ``sonar`` to this checkout, first on ``sys.path``; carried wheels (``--wheels DIR``: DeepSpeed, omegaconf,
    msgpack and their small dependencies, ``bench/gpu_wheels.sh`` downloads them) installed into a temporary
    target beside it, never into the machine's site-packages (its torch stays as it is)."""
    import subprocess
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="sonar-gpu-check-"))
    if args.wheels:
        # by name: pip picks each package's wheel for this Python from the folder (several are carried)
        names = sorted({w.name.split("-")[0].replace("_", "-").lower() for w in Path(args.wheels).glob("*.whl")})
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links",
                        str(args.wheels), "--target", str(tmp / "site"), *names], check=True)
        sys.path.insert(0, str(tmp / "site"))
    try:
        import sonar  # noqa: F401
    except ImportError:
        (tmp / "sonar").symlink_to(REPO, target_is_directory=True)
        sys.path.insert(0, str(tmp))
    import sonar  # noqa: F401,F811

    return tmp


def check_zero2_rl_step(torch, args, lora_rank: int = 0) -> dict:
    """One ZeRO-2 bf16 ``rl_step`` of Sonar's learner (DeepSpeed, gradient checkpointing, 1,024-token logit
    chunks) on a randomly initialised Qwen2.5-1.5B shape at ``--rl-tokens`` tokens, world of one: its peak
    ``torch.cuda.max_memory_allocated`` against the memory plan's learner figure for the same config
    (``cluster/wire/memory.py``). ``lora_rank`` > 0: the policy wrapped as a LoRA learner wraps it
    (``with_lora``: the base frozen, only the adapters in the optimizer), the plan's LoRA rows. Needs DeepSpeed
    and omegaconf (and peft for LoRA; ``--wheels``); SKIP without them."""
    try:
        import_sonar(args)
        import deepspeed  # noqa: F401
        import omegaconf  # noqa: F401
        if lora_rank:
            import peft  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return {"status": "SKIP", "figure": f"needs DeepSpeed, omegaconf{' and peft' if lora_rank else ''} "
                                            f"({type(e).__name__}: {e}); carry them with --wheels (bench/gpu_wheels.sh)"}
    import numpy as np

    from sonar.cluster.wire import metrics as K
    from sonar.cluster.wire.config import load_config
    from sonar.cluster.wire.memory import plan_for
    from sonar.cluster.wire.protocol import Segment, SegmentKind, Trajectory
    from sonar.learner.deepspeed_config import deepspeed_config
    from sonar.learner.train_step import DeepSpeedStepper, rl_step
    from sonar.learner.worker import _import_deepspeed_without_shm_jit, _init_process_group_on_loopback

    cuda = DEVICE == "cuda"
    shape = REPO / "tests/fixtures/model_shapes" / ("qwen2.5-1.5b" if cuda else "")
    seq = 2048 if cuda else 32
    rows = max(2, args.rl_tokens // seq) if cuda else 4
    tokens = rows * seq
    over = ["learner.precision=" + ("bf16" if cuda else "fp32"), "learner.zero_stage=2", "learner.gradient_checkpointing=true",
            "learner.logits_chunk_tokens=1024" if cuda else "learner.logits_chunk_tokens=8",
            f"learner.micro_batch_tokens={tokens}", f"learner.groups_per_step={rows // 2}", "rollout.group_size=2",
            "replay.capacity_groups=64", "stages.0.algo.kl_coef=0", "world.force=true", "cluster.gpu_memory_gib=1000",
            f"learner.lora.rank={lora_rank}"]
    if cuda:
        over += [f"model.path={shape}", "learner.num_gpus=1"]
    cfg = load_config([], over, notes=[])
    plan, why = plan_for(cfg) if cuda else (None, "CPU smoke: no plan")
    if cuda:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.bfloat16).to(DEVICE)
        vocab = model.config.vocab_size
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=args.vocab, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        vocab = args.vocab
    model.gradient_checkpointing_enable()
    if lora_rank:  # as the learner does (learner/worker.py)
        from sonar.cluster.wire.policy import with_lora

        model = with_lora(model, cfg.learner.lora, seed=0)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")  # as the learner sets them (a world of one)
    ds = _import_deepspeed_without_shm_jit()
    if not torch.distributed.is_initialized():
        _init_process_group_on_loopback("nccl" if cuda else "gloo", 0, 1, None)
        ds.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, opt, _, _ = ds.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-6),
                                      config=deepspeed_config(cfg.learner, cuda))
    rng = np.random.default_rng(0)
    groups = []
    for g in range(rows // 2):
        grp = []
        for r in (1.0, 0.0):
            segs = [Segment(SegmentKind.PROMPT, rng.integers(3, vocab, seq // 4).astype(np.int32)),
                    Segment(SegmentKind.MODEL, rng.integers(3, vocab, seq - seq // 4).astype(np.int32),
                            (rng.normal(size=seq - seq // 4) - 8).astype(np.float32), 0)]
            grp.append(Trajectory(f"t{g}-{r}", f"g{g}", f"g{g}", 0, segs, reward=r))
        groups.append(grp)
    sync(torch)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    metrics = rl_step(DeepSpeedStepper(engine, 2), groups, [0] * len(groups), cfg.stages[0].algo, cfg.learner,
                      cfg.replay, temperature=1.0, pad_id=0, device=engine.device)
    sync(torch)
    step_s = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    # colocated placement's learner.offload_while_generating (learner/worker.py: offload_states): what DeepSpeed
    # moves to host memory (optimizer states, fp32 master, gradients; the bf16 parameters stay) and back
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

    freed = offload_s = reload_s = None
    if cuda:  # (on CPU there is no device memory to move: the CPU learner never offloads)
        before = torch.cuda.memory_allocated()
        t_off = time.perf_counter()
        engine.offload_states(include=[S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer])
        sync(torch)
        offload_s = time.perf_counter() - t_off
        freed = (before - torch.cuda.memory_allocated()) / 2**30
        t_re = time.perf_counter()
        engine.reload_states()
        sync(torch)
        reload_s = time.perf_counter() - t_re
    n_params = sum(p.numel() for p in params)
    expected_freed = 12 * n_params / 2**30  # fp32 master 4N + Adam m, v 8N (ZeRO-2, one rank); gradients beside
    planned = plan.learner.total / 2**30 if plan is not None and getattr(plan, "learner", None) is not None else None
    out = {"tokens": tokens, "rows": rows, "lora_rank": lora_rank, "trained_params": n_params, "step_s": step_s,
           "peak_gib": peak, "plan_learner_gib": planned,
           "plan_note": why, "loss": float(metrics.get(K.LEARNER_LOSS, float("nan"))),
           "offload_freed_gib": freed, "offload_expected_at_least_gib": expected_freed, "offload_s": offload_s,
           "reload_s": reload_s}
    if not cuda:
        return {**out, "status": "PASS", "figure": f"CPU smoke rl_step in {step_s:.2f} s"}
    ok = planned is not None and peak <= planned and freed >= 0.9 * expected_freed
    return {**out, "status": "PASS" if ok else "FAIL",
            "figure": f"peak {peak:.1f} GiB vs planned {planned if planned is None else round(planned, 1)} GiB "
                      f"({tokens} tokens, {step_s:.1f} s); offload_states freed {freed:.1f} GiB "
                      f"(>= {expected_freed:.1f} expected) in {offload_s:.1f} s, back in {reload_s:.1f} s"}


def check_zero2_lora_rl_step(torch, args) -> dict:
    """``zero2_rl_step`` with ``learner.lora.rank=16`` (``configs/lora.yaml``): the LoRA learner's peak against
    the plan's LoRA rows, and ``offload_states`` moving the adapters' optimizer state only."""
    if DEVICE == "cuda":
        torch.cuda.empty_cache()  # the full-model check's engine is gone: its cached blocks would count here
    return check_zero2_rl_step(torch, args, lora_rank=16)


# ------------------------------------------------------------------------------------------------ main
CHECKS = {"nccl_broadcast": check_nccl_broadcast, "learner_step": check_learner_step, "cuda_ipc": check_cuda_ipc,
          "dp_sum_nccl": check_dp_sum_nccl, "push_memory_and_timing": check_push_memory_and_timing,
          "checksum_memory": check_checksum_memory, "nograd_forward_memory": check_nograd_forward_memory,
          "colocated_handover": check_colocated_handover,
          "zero2_rl_step": check_zero2_rl_step,  # the last two leave DeepSpeed's process group initialised
          "zero2_lora_rl_step": check_zero2_lora_rl_step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--only", nargs="+", choices=list(CHECKS), default=list(CHECKS),
                   help="the checks to run, in this order (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the broadcast and IPC checks")
    p.add_argument("--steps", type=int, default=3, help="timed learner steps per variant")
    p.add_argument("--rows", type=int, default=16, help="trajectories per learner step of the step checks")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per trajectory of the step checks")
    p.add_argument("--chunk", type=int, default=1024, help="learner.logits_chunk_tokens of the chunked variant")
    p.add_argument("--hidden", type=int, default=896, help="hidden width of the step checks' model")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the step checks' model")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary rows of the models and states (default: Qwen2.5's)")
    p.add_argument("--state-layers", type=int, default=QWEN05B["layers"],
                   help="decoder layers of the 0.5B-shaped state (24: 494M parameters)")
    p.add_argument("--group-timeout-s", type=float, default=120.0,
                   help="seconds the broadcast group's rendezvous and each send may take")
    p.add_argument("--rl-tokens", type=int, default=32_768, help="tokens of the zero2_rl_step check's batch")
    p.add_argument("--wheels", default=None, help="a folder of carried wheels (bench/gpu_wheels.sh) for zero2_rl_step")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CI: run every check on CPU at toy sizes (gloo, shared memory) to exercise the code")
    args = p.parse_args(argv)
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
        args.vocab, args.state_layers, args.rows, args.seq_len, args.chunk = 1000, 1, 2, 33, 8
        args.hidden, args.layers, args.steps, args.repeats = 64, 1, 1, 1
    t0 = time.time()
    doc: dict = {"script": "bench/gpu_check.py", "python": platform.python_version(), "checks": {}}
    try:
        import torch
    except ImportError:
        torch = None
    cuda = torch is not None and (torch.cuda.is_available() or args.cpu_smoke)
    doc["device"] = DEVICE
    if torch is not None:
        doc["torch"] = torch.__version__
        doc["cuda"] = torch.version.cuda
    if cuda and DEVICE == "cuda":
        doc["gpu"] = torch.cuda.get_device_name(0)
        doc["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    failed = False
    for name in args.only:
        if not cuda:
            res = {"status": "SKIP", "figure": "no CUDA device" if torch is not None else "torch not installed"}
        else:
            t = time.time()
            try:
                res = CHECKS[name](torch, args)
            except Exception as e:  # noqa: BLE001 - every check reports, the next one still runs
                res = {"status": "FAIL", "figure": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            res["wall_s"] = round(time.time() - t, 1)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        failed |= res["status"] == "FAIL"
        doc["checks"][name] = res
        print(f"{res['status']:<4} {name}: {res['figure']}", flush=True)
    doc["wall_s"] = round(time.time() - t0, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
