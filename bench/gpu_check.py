"""GPU device check (issue 12): three checks in under 5 minutes on one GPU, with torch alone.

    python bench/gpu_check.py --out $OUT/gpu.json      # from the repository root

Needs torch only; transformers is used when present (a Qwen2-shaped model), else a plain torch decoder
stand-in. No Sonar module that imports Ray, DeepSpeed or MLflow is imported: Sonar's own weight-broadcast
code (``cluster/wire/weights.py``) and chunked logprobs (``learner/algo/chunked.py``) import only torch
and are loaded by file path.

1. ``nccl_broadcast``: Sonar's ``BroadcastGroup`` with the NCCL backend, world of one (one GPU holds one
   NCCL rank), created under a deadline; then its send path (``plan_buckets`` + ``send_weights``: the
   flatten into the reused bucket buffers and the broadcast) for a 0.5B-parameter bf16 state shaped like
   Qwen2.5-0.5B, timed between ``torch.cuda.synchronize()`` calls. Figure: GB/s of the send path.
2. ``learner_step``: a bf16 learner step (forward, GRPO-style masked policy-gradient loss over the
   float32 token logprobs, backward, AdamW) at vocabulary 151,936, unchunked (the full
   [tokens, 151,936] logits) against chunked (``chunked_logprobs``, ``--chunk`` tokens). Figures:
   tokens/s and ``torch.cuda.max_memory_allocated`` of each; PASS when both run, their losses agree
   and the chunked step's peak memory is lower.
3. ``cuda_ipc``: a 0.5B-parameter bf16 state handed from this process to a second process on the same
   GPU through CUDA IPC (``torch.multiprocessing``: the tensor's IPC handle, no host copy), which copies
   it into its own buffer (the colocated learner -> engine path). Figure: GB/s from the put to the copy
   done in the receiver (both on the system-wide monotonic clock); the receiver's checksum must match.

Each check prints ``PASS``/``FAIL``/``SKIP`` with its figure; ``--out`` gets one JSON with every check.
Without CUDA every check is ``SKIP`` and the script exits 0.
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


def load_by_path(name: str, rel: str):
    """A Sonar module that imports only torch, loaded from its file (no ``sonar`` package needed)."""
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
    W = load_by_path("sonar_wire_weights", "cluster/wire/weights.py")
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
    grp.close()
    gbps = sent / best / 1e9
    return {"status": "PASS", "figure": f"{gbps:.1f} GB/s send path", "gb_per_s": gbps, "params": params,
            "bytes": sent, "buckets": len(buckets), "send_s": times[1:], "group_create_s": create_s,
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


# ------------------------------------------------------------------------------------------------ main
CHECKS = {"nccl_broadcast": check_nccl_broadcast, "learner_step": check_learner_step, "cuda_ipc": check_cuda_ipc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--only", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of the broadcast and IPC checks")
    p.add_argument("--steps", type=int, default=3, help="timed learner steps per variant")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=1024, help="learner.logits_chunk_tokens of the chunked variant")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--state-layers", type=int, default=QWEN05B["layers"],
                   help="decoder layers of the 0.5B-shaped state (24: 494M parameters)")
    p.add_argument("--group-timeout-s", type=float, default=120.0)
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
