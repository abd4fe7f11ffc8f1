"""The learner: a thin Ray actor around a DeepSpeed engine.

It trains on what it is given: the policy is loaded from the run's Hugging Face directory
(``cluster.wire.policy``), SFT demonstrations arrive from the driver as encoded groups
(``learner.sft_data``), and RL groups are pulled from the replay queue. Each learner step
(``learner.train_step``: one SFT batch, or one rollout batch of ``algo.ppo_epochs x algo.mini_batches``
optimizer steps) bumps the policy version once, so the policy lag counts rollout batches; weights go
to the rollout workers over the broadcast group (rank 0). It imports nothing of Sonar but the wires.
On CPU DeepSpeed runs fp32 with gloo; its shared-memory comm op (a ~90 s JIT build on a fresh
machine, useless for one CPU rank) is skipped.

Create with ``ray.remote(Learner)``; nothing here imports Ray at module level.
"""
from __future__ import annotations

from sonar.cluster.wire.bootstrap import role_process

role_process()  # first: in an actor's process, its thread and hub settings before torch and transformers load

import dataclasses
import functools
import os
import socket
import time
from contextlib import contextmanager, nullcontext
from typing import Sequence

from sonar.cluster.wire import metrics as K
from sonar.cluster.wire.algos import spec_of, trains_critic
from sonar.cluster.wire.config import Config, StageConfig
from sonar.cluster.wire.errors import ReplayUnresponsive
from sonar.cluster.wire.protocol import StepResult
from sonar.cluster.wire.startup import startup_without_gc


REFERENCE_FILE = "reference.pt"
"""In a checkpoint taken while a stage with a KL term runs: that stage's frozen reference policy."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# DeepSpeed imported with its shm comm op skipped (deepspeed_config.py has why); the old name stays for callers.
from sonar.learner.deepspeed_config import import_deepspeed_without_shm_jit as _import_deepspeed_without_shm_jit  # noqa: E402,F401


RENDEZVOUS_TIMEOUT_S = 1800.0
"""The learner ranks' store and process-group timeout (seconds)."""


def _init_process_group_on_loopback(backend: str, rank: int, world_size: int, master_port: int | None,
                                    master_addr: str = "127.0.0.1", store=None) -> None:
    """The learner's default process group (DeepSpeed adopts it), every socket on ``master_addr``'s side.

    ``deepspeed.init_distributed`` would call ``init_process_group("env://")``, whose master TCPStore
    listens on every interface; here rank 0's store listens on ``master_addr`` only (``master_store``; a
    ``store`` rank 0 bound already is used as is), the group is built on it (``store=``), and on loopback
    gloo's pair sockets (this group's and the subgroups DeepSpeed creates later) use the loopback
    interface (``GLOO_SOCKET_IFNAME``, unless the user set it). ``master_port`` None: rank 0 takes a port
    the OS picks (a single-rank learner, or one that binds before starting its peers)."""
    import datetime

    import torch.distributed as dist

    from sonar.cluster.transport.weights import is_loopback, loopback_interface, master_store

    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    if store is None and rank == 0:
        store = master_store(master_addr, master_port or 0, world_size, timeout.total_seconds())
    elif store is None:
        store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=False, timeout=timeout)
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(store.port)
    if backend == "gloo" and is_loopback(master_addr):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def on_all_ranks(fn):
    """A learner method every rank runs: called on rank 0 (the driver's handle), it is sent to every other
    rank first (Ray preserves each actor's call order, so the ranks' collectives pair up), runs here, and
    returns rank 0's result after the others finished (their errors raise here). Nested calls (a
    collective method calling another) do not fan out again."""
    name = fn.__name__

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        if not self._peers or self._fanning:
            return fn(self, *args, **kwargs)
        import ray

        refs = [getattr(p, name).remote(*args, **kwargs) for p in self._peers]
        self._fanning = True
        try:
            out = fn(self, *args, **kwargs)
        finally:
            self._fanning = False
        ray.get(refs)
        return out

    return run


class Learner:
    """``policy``: the Hugging Face directory of the run's initial policy (the driver materialises it;
    the KL reference and the exports are built from it too)."""

    @startup_without_gc()  # DeepSpeed's and transformers' imports, the policy load (cluster/wire/startup.py)
    def __init__(self, cfg: Config, policy: str, rank: int = 0, world_size: int | None = None,
                 master_port: int | None = None, master_addr: str | None = None, placement_group=None):
        """``world_size`` (default ``learner.num_ranks``) ranks form one DeepSpeed group. Started by the
        driver with a Ray ``placement_group`` (one bundle per rank, this actor in bundle 0), rank 0 binds
        the group's store on its node address (``learner.rendezvous``) and starts ranks 1.. as Ray actors
        it owns, one per bundle (they die with it). Without one, every rank is started by the caller with
        ``master_addr``/``master_port`` (tests start the ranks as processes)."""
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
        from sonar.cluster.wire.policy import load_policy, pad_id
        from sonar.learner.deepspeed_config import (deepspeed_config, resolve_backend, train_dtype,
                                                    uses_client_optimizer, zero3_loading)
        from sonar.learner.sft_data import SFTData

        self.cfg = cfg
        self.policy = policy
        world_size = cfg.learner.num_ranks if world_size is None else int(world_size)
        self.rank, self.world_size = rank, world_size
        self._peers: list = []
        self._fanning = False
        self.on_gpu = torch.cuda.is_available() and cfg.learner.num_gpus > 0
        master_addr = master_addr or "127.0.0.1"
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port or 0))
        deepspeed = _import_deepspeed_without_shm_jit()
        torch.manual_seed(cfg.run.seed)
        backend = resolve_backend(cfg.learner, self.on_gpu)
        # The group first: ZeRO-3 loading partitions the model over it while it is built.
        if not torch.distributed.is_initialized():
            store = None
            if rank == 0 and world_size > 1 and placement_group is not None:
                store, master_addr = self._start_peers(placement_group)
            _init_process_group_on_loopback(backend, rank, world_size, master_port, master_addr, store)
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)  # adopts that group
        elif torch.distributed.get_world_size() != world_size:
            raise RuntimeError(f"this process's torch.distributed group has {torch.distributed.get_world_size()} "
                               f"ranks, the learner was asked for {world_size}")
        self.ds_config = deepspeed_config(cfg.learner, self.on_gpu)
        self.dtype = getattr(torch, train_dtype(cfg.learner, self.on_gpu))
        self.zero3 = cfg.learner.zero_stage == 3
        # ZeRO-3: built inside zero.Init and loaded into its partitions, so no rank holds the whole model
        # (``zero3_loading``); below ZeRO-3 every rank holds the full parameters anyway. Loaded in the training
        # dtype: DeepSpeed would cast a float32 model to bf16 itself (its fp32 master copy is made from the
        # bf16 parameters either way), so only the host memory of the load differs.
        with zero3_loading(self.ds_config):
            model, self.tokenizer = load_policy(policy, dtype=self.dtype)
        self.pad_id = pad_id(model, self.tokenizer)
        if cfg.learner.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.lora = cfg.learner.lora if cfg.learner.lora.rank else None
        if self.lora is not None:  # the base frozen: only the adapters reach the optimizer (learner/lora.py)
            from sonar.cluster.wire.policy import with_lora

            kl = any(st.kind == "rl" and st.algo.kl_coef > 0 for st in cfg.stages)
            # (checkpointing is transformers' non-reentrant kind, which needs no input that requires a gradient
            # to carry one to the adapters behind the frozen embeddings)
            model = with_lora(model, self.lora, cfg.run.seed, reference=kl)
        params = [p for p in model.parameters() if p.requires_grad]
        # lr=0.0 is a placeholder: every step sets the stage's scheduled lr first (``_set_lr``). With optimizer
        # offload DeepSpeed builds its own AdamW from the config (it refuses a client torch optimizer).
        opt = (torch.optim.AdamW(params, lr=0.0, betas=tuple(cfg.learner.betas), weight_decay=cfg.learner.weight_decay)
               if uses_client_optimizer(cfg.learner) else None)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, model_parameters=params if opt is None else None, config=self.ds_config)
        self.device = self.engine.device
        from sonar.learner.train_step import DeepSpeedStepper

        self.stepper = DeepSpeedStepper(self.engine, cfg.learner.zero_stage)
        self.ref_module = None
        self.version = 0
        self.global_step = 0
        self.stage_step = 0
        self.stage_index = 0
        self._group = None
        self._buckets = None
        self.sft_data = SFTData(cfg.run.seed)
        # PPO's value model, built once when any RL stage's algorithm takes a critic (checkpointed with the policy).
        self.critic = None
        if trains_critic(cfg):
            from sonar.learner.critic import Critic

            # under DeepSpeed like the policy: the same ZeRO stage and precision, its own AdamW (critic.lr)
            self.critic = Critic(cfg.critic, cfg.learner, policy_dir=policy, policy_module=self.engine.module,
                                 device=self.device, ds_config=self.ds_config)

    # ------------------------------------------------------------------ ranks
    def _start_peers(self, placement_group):
        """Rank 0 under Ray: bind the ranks' store (the node address Ray reports, or 127.0.0.1 with
        ``learner.rendezvous='loopback'``) and start ranks 1.. in bundles 1.. of ``placement_group``.
        Returns (store, address)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from sonar.cluster.transport.weights import master_store

        L = self.cfg.learner
        host = "127.0.0.1" if L.rendezvous == "loopback" else ray.util.get_node_ip_address()
        store = master_store(host, 0, self.world_size, RENDEZVOUS_TIMEOUT_S)
        cls = ray.remote(type(self))
        from sonar.cluster.wire.resolved import ray_gpus

        self._peers = [cls.options(num_cpus=L.num_cpus, num_gpus=ray_gpus(self.cfg, "learner"), scheduling_strategy=(
            PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=r))).remote(
                self.cfg, self.policy, rank=r, world_size=self.world_size, master_port=store.port, master_addr=host)
            for r in range(1, self.world_size)]
        return store, host

    # ------------------------------------------------------------------ weights
    def _pushed(self) -> list:
        """``(name, parameter)`` a weight push moves (model order): the trained ones. Full fine-tuning: every
        parameter; LoRA: the adapters (the engines hold the same frozen base)."""
        return [(n, p) for n, p in self.engine.module.named_parameters() if p.requires_grad]

    @contextmanager
    def _gathered(self, params: list | None = None):
        """``params`` (default: every parameter) by name as detached full views, no copies: under ZeRO-3
        gathered for the block (a collective: every rank enters it), else the live parameters."""
        import deepspeed

        params = list(self.engine.module.named_parameters()) if params is None else params
        ctx = (deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
               if self.cfg.learner.zero_stage == 3 else nullcontext())
        with ctx:
            yield {n: p.detach() for n, p in params}

    @on_all_ranks
    def named_tensors(self) -> dict:
        """Full (gathered) parameters by name, in the model's parameter order: copies."""
        with self._gathered() as views:
            return {n: t.to("cpu" if not self.on_gpu else t.device).clone() for n, t in views.items()}

    @on_all_ranks
    def param_specs(self) -> list:
        """Names, full shapes and dtypes of what a push moves (``_pushed``), in model order. Under ZeRO-3 the
        full shape is DeepSpeed's ``ds_shape``: nothing is gathered (a gather of the whole model would put
        2 B x N on every rank)."""
        from sonar.cluster.transport.weights import TensorSpec

        specs = [TensorSpec(n, tuple(getattr(p, "ds_shape", p.shape)), p.dtype) for n, p in self._pushed()]
        self._specs = specs  # every rank: the others rebuild rank 0's bucket plan from it (``broadcast``)
        return specs

    @contextmanager
    def _gathered_only(self, names):
        """The named parameters as detached full views for the block: under ZeRO-3 gathered for these
        parameters only (a collective: every rank enters the same blocks in the same order)."""
        import deepspeed

        params = dict(self.engine.module.named_parameters())
        chosen = [params[n] for n in names]
        ctx = (deepspeed.zero.GatheredParameters(chosen, modifier_rank=None)
               if self.cfg.learner.zero_stage == 3 else nullcontext())
        with ctx:
            yield {n: p.detach() for n, p in zip(names, chosen)}

    def broadcast_endpoint(self, world_size: int) -> tuple[str, int]:
        """Where the next broadcast group meets: this learner's node address (as Ray knows it; 127.0.0.1
        on a local cluster) and the port of a rendezvous store it binds now and holds until
        ``setup_broadcast`` takes it, so no other process can grab the port in between."""
        import ray

        from sonar.cluster.transport.weights import open_store, resolve_bind_host

        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        host = resolve_bind_host(self.cfg.cluster.bind_host, ray.util.get_node_ip_address(), nodes)
        self._abandoned_store = None  # the previous formation's ranks have all answered by now (the pool waits)
        self._bcast_store = open_store(host, world_size, timeout_s=self.cfg.cluster.broadcast_timeout())
        return host, int(self._bcast_store.port)

    def setup_broadcast(self, master_addr: str, master_port: int, world_size: int, backend: str, prefix: str) -> str:
        from sonar.cluster.transport.weights import BroadcastGroup, layout_digest, plan_buckets

        specs = self.param_specs()
        self._buckets = plan_buckets(specs)
        store = getattr(self, "_bcast_store", None)
        self._bcast_store = None
        if store is not None and store.port != master_port:
            store = None  # a stale endpoint: bind master_port instead
        # Every wait of a push is bounded: a dead receiver raises within the group's timeout.
        try:
            self._group = BroadcastGroup(master_addr, master_port, 0, world_size, backend, prefix=prefix,
                                         store=store, timeout_s=self.cfg.cluster.broadcast_timeout())
        except BaseException:
            # The meeting point stays open until the next formation's: a rank still dialling it (slow to
            # start) finds the formation called off at once, where a closed port would have it retry its
            # connect for the group's whole timeout.
            self._abandoned_store = store
            raise
        return layout_digest(specs)

    @on_all_ranks
    def broadcast(self) -> dict:
        """Rank 0 sends the full weights, streamed from the (gathered) parameters through the group's two
        reused bucket buffers (``send_weights``): no copy of the model. Other ranks only join ZeRO-3's gather.

        ``seconds``: the transfer, from the handshake (every receiver there) to the completion of the last
        broadcast (``work.wait`` on every bucket, then ``torch.cuda.synchronize`` on CUDA), so
        ``weights/sync_s`` and ``weights/gbps`` are the transfer and not the enqueue; ``wait_s``: the wait
        for the receivers (a vLLM engine in pause mode drains its rows first); ``wall_s``: the whole call
        (ZeRO-3's gather included)."""
        t0 = time.perf_counter()
        zero3 = self.cfg.learner.zero_stage == 3
        if self.rank != 0:
            if zero3:  # join rank 0's gathers, bucket by bucket, in its order (the same pure bucket plan)
                from sonar.cluster.transport.weights import plan_buckets

                specs = getattr(self, "_specs", None) or self.param_specs()  # no collective: ds_shape
                for b in plan_buckets(specs):
                    with self._gathered_only([sp.name for sp in b.specs]):
                        pass
            return {}
        if zero3:
            # Gathered one bucket at a time (at most a bucket of full parameters beside the partitions,
            # not the whole model: cluster/wire/memory.py plans it so); copied into the stream buffers
            # inside the gather, so nothing is sent from a parameter that is released afterwards.
            nbytes = self._group.send_weights(self._buckets, None, gather=lambda b: self._gathered_only(
                [sp.name for sp in b.specs]))
        else:
            with self._gathered(self._pushed()) as views:
                nbytes = self._group.send_weights(self._buckets, views)
        push = self._group.last_push
        return {"version": self.version, "bytes": nbytes, "seconds": push["seconds"], "wait_s": push["wait_s"],
                "wall_s": time.perf_counter() - t0, "buckets": len(self._buckets), "in_place": push["in_place"],
                "buffer_bytes": push["buffer_bytes"]}

    @on_all_ranks
    def checksum(self) -> dict:
        """``weights.checksum`` of the (gathered) tensors a push moves (``_pushed``: with LoRA the adapters, the
        base being the policy directory every role loads): the receivers' function, chunked (no full-tensor
        float64 copy)."""
        from sonar.cluster.transport.weights import Checksum, checksum

        if self.cfg.learner.zero_stage != 3:
            with self._gathered(self._pushed()) as views:
                return {"version": self.version, "checksum": checksum(views.items())}
        sums = Checksum()  # ZeRO-3: one parameter gathered at a time, added in model order as checksum() does
        for name, _ in self._pushed():
            with self._gathered_only([name]) as one:
                sums.add(name, one[name])
        return {"version": self.version, "checksum": sums.value}

    # ------------------------------------------------------------------ colocated placement
    def _engines(self) -> list:
        """The DeepSpeed engines of this rank: the policy's, and the PPO critic's when there is one."""
        critic = getattr(self.critic, "engine", None) if self.critic is not None else None
        return [self.engine] + ([critic] if critic is not None else [])

    @on_all_ranks
    def offload_states(self) -> dict:
        """Colocated placement, after the hand-over: the states the engine on this GPU does not need wait in
        host memory while it generates (``learner.offload_while_generating``; DeepSpeed's
        ``offload_states``: optimizer states, fp32 master, gradients; the bf16 parameters stay, as the
        memory plan's generation row counts). On CPU, or with the field off, nothing moves. Returns
        ``{"seconds", "moved"}``."""
        t0 = time.perf_counter()
        moved = bool(self.on_gpu and self.cfg.learner.offload_while_generating)
        if moved:  # pragma: no cover - needs CUDA (bench/gpu_check.py's DeepSpeed step)
            import torch
            from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S

            for engine in self._engines():
                engine.offload_states(include=[S.optim_states, S.hp_params, S.lp_grads, S.contiguous_grad_buffer])
            torch.cuda.empty_cache()
        return {"seconds": time.perf_counter() - t0, "moved": moved}

    @on_all_ranks
    def reload_states(self) -> dict:
        """Undo :meth:`offload_states` before the next step (the engines on this GPU are asleep)."""
        t0 = time.perf_counter()
        moved = bool(self.on_gpu and self.cfg.learner.offload_while_generating)
        if moved:  # pragma: no cover - needs CUDA
            for engine in self._engines():
                engine.reload_states()
        return {"seconds": time.perf_counter() - t0, "moved": moved}

    # ------------------------------------------------------------------ stages
    @on_all_ranks
    def begin_stage(self, stage_index: int, stage: StageConfig, start_step: int = 0,
                    demonstrations: Sequence[bytes] = ()) -> dict:
        """``start_step`` > 0 continues a stage after a resume (LR schedule and data order included).
        An SFT stage needs ``demonstrations``: encoded groups (``encode_group``) built by the driver."""
        self.stage_index = stage_index
        self.stage_step = start_step
        info = {"stage": stage_index, "kind": stage.kind}
        # KL reference = the policy at the start of the stage (frozen); skipped when the coefficient is 0.
        self.ref_module = None
        if stage.kind == "rl" and stage.algo.kl_coef > 0 and self.lora is not None:
            # LoRA: the reference is a frozen adapter beside the trained one (learner/lora.py). Resumed
            # mid-stage, it came back with the checkpoint's module state; else it takes the adapter's values now.
            from sonar.learner.lora import AdapterReference, set_reference

            if start_step == 0:
                set_reference(self.engine.module, self.zero3, self.rank)
            self.ref_module = AdapterReference(self.engine.module)
        elif stage.kind == "rl" and stage.algo.kl_coef > 0:
            # Resumed mid-stage, the current weights are not the stage's start: the reference comes from the
            # checkpoint, which saved it (``REFERENCE_FILE``).
            self.ref_module = self._build_reference(self._resumed_reference(stage_index) if start_step > 0 else None)
        if stage.kind == "sft":
            if not demonstrations:
                raise ValueError(f"stages[{stage_index}] (kind 'sft') started without demonstrations")
            info["demonstrations"] = self.sft_data.set_demonstrations(demonstrations)
        return info

    def _resumed_reference(self, stage_index: int) -> dict:
        """The KL reference a mid-stage checkpoint saved (the policy at the start of its stage)."""
        import torch

        path = getattr(self, "_resume_from", None)
        ref = None if path is None else os.path.join(path, REFERENCE_FILE)
        if ref is None or not os.path.isfile(ref):
            raise ValueError(f"stages[{stage_index}] resumes at step {self.stage_step} with a KL term, but the "
                             f"checkpoint {path!r} holds no {REFERENCE_FILE} (the policy at the stage's start): "
                             "the KL reference cannot be rebuilt")
        # memory-mapped: under ZeRO-3 only rank 0 reads the tensors, and no rank copies the file into RAM
        return torch.load(ref, map_location="cpu", weights_only=True, mmap=True)

    def _build_reference(self, saved: dict | None):
        """The frozen KL reference, holding the policy's current weights (``saved`` None) or a checkpoint's
        (``REFERENCE_FILE``), in the training dtype (bf16 on a bf16 run).

        ZeRO-3: a DeepSpeed inference engine (``deepspeed_config.reference_config``: stage 3, no optimizer),
        built inside ``zero.Init`` so it is partitioned with the policy from the start (1/R of the
        parameters per rank, never a full copy) and filled one parameter at a time (``_copy_params`` /
        ``_load_params``).
        ZeRO 0-2: a plain module on the device (those stages hold full parameters on every rank anyway).
        Built from the policy's config with no weight initialisation (every parameter is written); the
        buffers (RoPE's inverse frequencies) are the policy's own tensors, copied, so the reference computes
        exactly what the policy computed at the stage's start."""
        import copy

        import torch
        from transformers import AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        from sonar.cluster.wire.policy import ATTN_IMPLEMENTATION
        from sonar.learner.deepspeed_config import reference_config

        policy = self.engine.module
        config = copy.deepcopy(policy.config)
        if self.zero3:
            deepspeed = _import_deepspeed_without_shm_jit()
            ref_cfg = reference_config(self.cfg.learner, self.on_gpu)
            # mem_efficient_linear=False: zero.Init would otherwise replace torch.nn.functional.linear for good
            where = deepspeed.zero.Init(config_dict_or_path=ref_cfg, mem_efficient_linear=False)
        else:
            where = torch.device(self.device)
        with no_init_weights(), where:
            ref = AutoModelForCausalLM.from_config(config, dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION)
        ref.tie_weights()  # no_init_weights skips init_weights, which is where transformers ties them
        ref.requires_grad_(False)
        if self.zero3:
            ref, *_ = deepspeed.initialize(model=ref, config=ref_cfg)
        module = getattr(ref, "module", ref)
        names = [n for n, _ in module.named_parameters()]
        if names != [n for n, _ in policy.named_parameters()]:
            raise RuntimeError(f"the KL reference built from {self.policy}'s config has other parameters than the "
                               f"policy: {names[:4]}...")
        if saved is None:
            self._copy_params(policy, module)
        else:
            missing = [n for n in names if n not in saved]
            if missing:
                raise ValueError(f"the checkpoint's {REFERENCE_FILE} lacks parameters {missing[:4]} of the policy")
            self._load_params(module, saved)
        live = dict(policy.named_buffers())
        for name, buf in module.named_buffers():
            buf.data = live[name].detach().clone()
        ref.eval()  # (DeepSpeedEngine.eval returns None)
        return ref

    def _copy_params(self, src, dst) -> None:
        """``dst``'s parameters set to ``src``'s (same names), one parameter at a time: under ZeRO-3 both are
        gathered (every rank joins), rank 0 writes and ``dst`` is re-partitioned from rank 0's copy."""
        import deepspeed

        source = dict(src.named_parameters())
        for name, q in dst.named_parameters():
            p = source[name]
            if not self.zero3:
                q.data.copy_(p.data)
                continue
            with deepspeed.zero.GatheredParameters([p]), deepspeed.zero.GatheredParameters([q], modifier_rank=0):
                if self.rank == 0:
                    q.data.copy_(p.data)

    def _load_params(self, module, tensors: dict) -> None:
        """``module``'s parameters set from ``tensors`` (name -> full CPU tensor), one at a time; under ZeRO-3
        only rank 0 reads ``tensors`` (gathered, written, re-partitioned from rank 0)."""
        import deepspeed

        for name, p in module.named_parameters():
            if not self.zero3:
                p.data.copy_(tensors[name])
                continue
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if self.rank == 0:
                    p.data.copy_(tensors[name])

    def _param_state(self, module) -> dict | None:
        """Rank 0: ``module``'s full parameters (tied ones once, ``named_parameters`` order) and persistent
        buffers by name, as CPU copies in the training dtype; other ranks None. Under ZeRO-3 gathered one
        parameter at a time (every rank joins each gather, only rank 0 copies), so no device holds more
        than one parameter beyond its partition and no other rank builds anything; below ZeRO-3 the
        other ranks do nothing."""
        import deepspeed

        if self.rank != 0 and not self.zero3:
            return None
        out = {} if self.rank == 0 else None
        for name, p in module.named_parameters():
            with deepspeed.zero.GatheredParameters([p]) if self.zero3 else nullcontext():
                if out is not None:
                    out[name] = p.detach().to("cpu", dtype=self.dtype, copy=True)
        if out is not None:
            params = {id(p) for p in module.parameters()}
            for name, t in module.state_dict(keep_vars=True).items():
                if id(t) not in params and name not in out:  # a persistent buffer (not partitioned by ZeRO-3)
                    out[name] = t.detach().to("cpu", dtype=self.dtype if t.is_floating_point() else t.dtype, copy=True)
        return out

    def _write_export(self, path) -> None:
        """The policy as a Hugging Face directory at ``path`` in the training dtype: rank 0 streams the
        gathered parameters into CPU copies (``_param_state``) and writes them through a weightless
        (meta-device) model of the policy's config; the other ranks only join ZeRO-3's gathers."""
        state = self._param_state(self.engine.module)
        if self.rank == 0:
            from sonar.cluster.wire.policy import load_policy, save_policy

            if self.lora is not None:  # the adapter as peft writes it, then the model it serves, merged
                from sonar.cluster.wire.policy import ADAPTER_DIR, write_adapter
                from sonar.learner.lora import merged

                write_adapter(state.items(), dataclasses.asdict(self.lora), os.path.join(path, ADAPTER_DIR),
                              base=self.policy)
                state = merged(state, self.lora)
            skeleton, _ = load_policy(self.policy, weights=False, dtype=self.dtype)
            save_policy(skeleton, self.tokenizer, path, state_dict=state)

    def _set_lr(self, stage: StageConfig) -> float:
        from sonar.learner.deepspeed_config import lr_at

        base = stage.lr * (self.lora.lr_scale if self.lora is not None else 1.0)  # LoraConfig.lr_scale: why
        lr = lr_at(self.stage_step, base, self.cfg.learner.warmup_steps, self.cfg.learner.lr_decay, stage.steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    @on_all_ranks
    def sft_step(self, stage: StageConfig) -> dict:
        """Every rank draws the same batch (the same seeded order) and trains its share of it."""
        from sonar.learner.train_step import sft_step

        lr = self._set_lr(stage)
        metrics = sft_step(self.stepper, self.sft_data.next(stage.batch_size), self.cfg.learner,
                           pad_id=self.pad_id, device=self.device, dp=(self.rank, self.world_size))
        return self._finish_step(metrics, lr)

    @on_all_ranks
    def rl_step(self, replay, stage: StageConfig, timeout_s: float) -> StepResult:
        """Pull a batch of whole groups and step. ``StepResult.waiting`` if the queue had nothing
        within ``timeout_s``, so the driver can check the workers' health instead of hanging."""
        import ray

        from sonar.cluster.wire.protocol import decode_group

        t_wait = time.perf_counter()
        res = self._replay_get(replay, timeout_s) if self.rank == 0 else None
        if self.world_size > 1:  # rank 0 alone pulls; every rank trains on the same groups
            from sonar.learner.collectives import broadcast_object

            res = broadcast_object(res, 0, (self.rank, self.world_size), self.device)
        wait_s = time.perf_counter() - t_wait
        if not res["groups"]:
            outage = res.get("outage") or {}  # the replay pauses the learner during a retrieval outage
            return StepResult({K.LEARNER_WAIT_S: wait_s, K.REPLAY_DROPPED_IN_GET: res["dropped"],
                               K.REPLAY_OUTAGE_NOW_S: outage.get("seconds", 0.0)},
                              dropped_prompts=res["dropped_prompts"], waiting=True)
        groups = [decode_group(p) for p in res["groups"]]
        metrics = self.train_groups(groups, res["lags"], stage)
        metrics[K.LEARNER_WAIT_S] = wait_s
        metrics[K.REPLAY_DROPPED_IN_GET] = res["dropped"]
        out = self._finish_step(metrics, metrics.pop(K.LEARNER_LR))
        if self.rank == 0:
            ray.get(replay.set_learner_version.remote(self.version))
        return StepResult(out, trained_prompts=res["prompts"], dropped_prompts=res["dropped_prompts"])

    def _replay_get(self, replay, timeout_s: float) -> dict:
        """The replay's ``get``: it waits ``timeout_s`` for a batch and answers; silent past that plus
        ``cluster.health_timeout_s``, the queue is hung (a stopped or deadlocked process), and the step
        fails naming it instead of holding the learner until the driver's ``step_timeout_s``."""
        import ray

        deadline = timeout_s + self.cfg.cluster.health_timeout_s
        try:
            return ray.get(replay.get.remote(self.cfg.learner.groups_per_step, self.version, timeout_s),
                           timeout=deadline)
        except ray.exceptions.GetTimeoutError:
            raise ReplayUnresponsive(f"the replay queue did not answer the learner's get within {deadline:g} s "
                                     f"(its {timeout_s:g} s wait + cluster.health_timeout_s="
                                     f"{self.cfg.cluster.health_timeout_s:g}): hung, a stopped or deadlocked process; "
                                     "the run's checkpoints hold its state (`sonar train run.resume=latest`)") from None

    @on_all_ranks
    def train_groups(self, groups: list, lags: list[int], stage: StageConfig) -> dict:
        """The RL step on decoded groups (``rl_step``); ``learner/lr`` holds the lr it ran at. A ppo stage
        trains the critic too, and only the critic during its first ``critic.warmup_steps`` steps."""
        from sonar.learner.train_step import rl_step

        lr = self._set_lr(stage)
        ppo = spec_of(stage.algo.name).critic  # the critic trains, and alone during its warm-up
        metrics = rl_step(self.stepper, groups, lags, stage.algo, self.cfg.learner, self.cfg.replay,
                          temperature=self.cfg.rollout.temperature, pad_id=self.pad_id,
                          device=self.device, ref_module=self.ref_module, difficulty=tuple(stage.difficulty),
                          critic=self.critic if ppo else None,
                          train_policy=not ppo or self.stage_step >= self.cfg.critic.warmup_steps,
                          dp=(self.rank, self.world_size))
        metrics[K.LEARNER_LR] = lr
        return metrics

    def _finish_step(self, metrics: dict, lr: float) -> dict:
        self.version += 1
        self.global_step += 1
        self.stage_step += 1
        metrics[K.LEARNER_LR] = lr
        metrics[K.LEARNER_VERSION] = self.version
        return metrics

    # ------------------------------------------------------------------ export / checkpoint
    @on_all_ranks
    def export_hf(self, path: str) -> str:
        """Rank 0 writes the policy in the training dtype, streamed from the parameters (``_write_export``;
        under ZeRO-3 every rank joins the per-parameter gathers and builds nothing)."""
        self._write_export(path)
        return path

    @on_all_ranks
    def save_checkpoint(self, path: str, client_state: dict) -> str:
        """Every rank writes its DeepSpeed partition into the one directory; rank 0 the rest and the rename."""
        from sonar.learner.checkpoint import save_checkpoint

        state = dict(client_state)
        state.update(version=self.version, global_step=self.global_step, stage_step=self.stage_step,
                     stage_index=self.stage_index, sft_data=self.sft_data.state_dict(),
                     num_ranks=self.world_size, zero_stage=self.cfg.learner.zero_stage)

        def every_rank(tmp):
            """Collective under ZeRO-3 (every rank joins the gathers, the critic engine's save); rank 0
            writes the files; one model's worth of CPU copies at a time."""
            self._write_export(str(tmp / "hf"))
            if self.ref_module is not None and self.lora is None:  # a resume mid-stage needs the stage's KL
                # reference (LoRA's is an adapter of the module, in the DeepSpeed checkpoint)
                import torch

                ref_state = self._param_state(getattr(self.ref_module, "module", self.ref_module))
                if self.rank == 0:
                    torch.save(ref_state, tmp / REFERENCE_FILE)
                del ref_state
            if self.critic is not None:
                self.critic.save(tmp, rank=self.rank)

        return save_checkpoint(self.engine, path, state, keep=self.cfg.run.keep_checkpoints, rank=self.rank,
                               world_size=self.world_size, device=self.device, write_every_rank=every_rank)

    @on_all_ranks
    def load_checkpoint(self, path: str) -> dict:
        from sonar.learner.checkpoint import load_checkpoint, read_state

        saved_ranks = int(read_state(path).get("num_ranks", self.world_size))
        if saved_ranks != self.world_size and self.cfg.learner.zero_stage > 0:
            from sonar.learner.checkpoint import CheckpointError

            raise CheckpointError(
                f"checkpoint {path!r} was written by {saved_ranks} learner ranks with ZeRO partitions and "
                f"learner.num_ranks={self.world_size}: DeepSpeed cannot repartition ZeRO 1-3 state; resume with "
                f"learner.num_ranks={saved_ranks} (a ZeRO-0 checkpoint resumes on any number of ranks)")
        state = load_checkpoint(self.engine, path, rank=self.rank)
        self._resume_from = path  # begin_stage(start_step > 0) reads the KL reference from here
        self.version = state["version"]
        self.global_step = state["global_step"]
        self.stage_step = state["stage_step"]
        self.stage_index = state["stage_index"]
        self.sft_data.load_state_dict(state.get("sft_data") or {})
        if self.critic is not None:
            self.critic.load(path)
        return state

    def ping(self) -> dict:
        """Rank 0 pings every other rank too (a dead rank raises here: the learner is dead)."""
        if self._peers:
            import ray

            ray.get([p.ping.remote() for p in self._peers])
        from sonar.cluster.wire.paths import code_origin

        return {"version": self.version, "pid": os.getpid(), "step": self.global_step, "ranks": self.world_size,
                "code": code_origin()}
