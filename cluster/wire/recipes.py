"""The papers' recipes as their released scripts set them, beside Sonar's presets, field by field.

Each shipped recipe (``configs/r1_searcher.yaml``, ``search_r1.yaml``, ``rag_r1.yaml``) has one table
here: for every Sonar field the upstream script decides, the upstream value in Sonar's units, the file
and line it comes from, how it was converted, and -- only where Sonar's recipe keeps another value on
purpose -- why. ``tests/cluster/test_recipes.py`` loads each preset and requires every row without a
``differs`` to hold the upstream value exactly (and every row with one to really differ, so a reason
never outlives its deviation); the README's recipe tables are this module's :func:`markdown` output
(``sonar config recipes``), kept equal by the same test. Each table opens with the model upstream trains and
the GPUs it trains on beside the preset's (:data:`GPUS`, :func:`preset_gpus`); its rows include the placement
(``cluster.placement``, the GPU counts, vLLM's share of a GPU) and the retriever.

Sources are pinned commits of the released code:

* R1-Searcher: ``RUCAIBox/R1-Searcher@631167c`` (its OpenRLHF fork and reward servers in the repo);
* Search-R1: ``PeterGriffinJin/Search-R1@a14dc3a`` (veRL fork);
* RAG-R1: ``inclusionAI/AWorld-RL@4aeef7b`` (``RAG-R1/``, a veRL fork).

Pure: the standard library and the config schema only.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

R1 = "RUCAIBox/R1-Searcher@631167c"
SR1 = "PeterGriffinJin/Search-R1@a14dc3a"
RAG = "inclusionAI/AWorld-RL@4aeef7b"


@dataclass(frozen=True)
class Row:
    """One upstream setting, expressed as the Sonar field it decides."""

    field: str
    """Dotted Sonar config path (``rollout.top_p``, ``stages.1.algo.kl_coef``, ``learner.betas``)."""
    upstream: Any
    """The upstream value in Sonar's units (after ``note``'s conversion)."""
    source: str
    """``repo@commit path:line`` of the upstream setting."""
    note: str = ""
    """How the upstream setting becomes this value (``rollout_batch_size 256 x n 16 / 1024 = 4``)."""
    differs: str = ""
    """Non-empty: the recipe keeps another value on purpose, and this says why."""
    caveat: str = ""
    """Non-empty: the value is upstream's but what it does differs in a way a reproducer should know."""


def get_field(cfg: Any, path: str) -> Any:
    """The value at a dotted path of a loaded config (list indices as numbers: ``stages.1.lr``)."""
    node = cfg
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    if dataclasses.is_dataclass(node):
        raise ValueError(f"{path} is a section, not a field")
    return list(node) if isinstance(node, (list, tuple)) else node


def mismatches(name: str, cfg: Any) -> list[str]:
    """Rows of recipe ``name`` that ``cfg`` contradicts: a row without ``differs`` whose field does not
    hold the upstream value, or a row with ``differs`` whose field does. [] = the preset is the recipe."""
    out = []
    for r in RECIPES[name]:
        have = get_field(cfg, r.field)
        same = _same(have, r.upstream)
        if not r.differs and not same:
            out.append(f"{r.field}: recipe has {have!r}, upstream {r.upstream!r} ({r.source})")
        elif r.differs and same:
            out.append(f"{r.field}: marked as differing ({r.differs}) but equals upstream {r.upstream!r}")
    return out


def preset_gpus(cfg: Any) -> int:
    """GPUs a loaded config asks for: colocated, one per learner rank (its engine shares it); split, the
    learner's plus every engine's."""
    L, r = cfg.learner, cfg.rollout
    learner = math.ceil(L.num_ranks * L.num_gpus)
    if cfg.cluster.placement == "colocated":
        return learner
    return learner + math.ceil(r.num_workers * r.num_gpus_per_worker)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return a == b


def _cell(text: str) -> str:
    """Table-safe text: tags such as <answer> shown, not read as HTML."""
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return "null" if v is None else str(v)


def markdown(name: str, cfg: Any) -> str:
    """Recipe ``name``'s table: field | Sonar preset | upstream | source | note (the README's block)."""
    model, where = MODELS[name]
    n, layout, src = GPUS[name]
    have = preset_gpus(cfg)
    lines = [f"**`configs/{name}.yaml`**: upstream trains {model} ({where}) on {n} GPUs: {_cell(layout)} ({src}). "
             f"The preset: {have} GPUs, {cfg.cluster.placement}.", "",
             f"| `{name}` field | preset | upstream | source | note |", "|---|---|---|---|---|"]
    for r in RECIPES[name]:
        have = get_field(cfg, r.field)
        note = "; ".join(x for x in (r.note, r.differs and f"**differs:** {r.differs}",
                                     r.caveat and f"**caveat:** {r.caveat}") if x)
        lines.append(f"| `{r.field}` | {_cell(_fmt(have))} | {_cell(_fmt(r.upstream))} | {r.source} | {_cell(note)} |")
    return "\n".join(lines) + "\n"


RECIPES: dict[str, tuple[Row, ...]] = {}
"""Recipe name (= preset name) -> its rows, in the order the README shows them."""

_L1 = f"{R1} scripts/llama_reinforce_plus_train_stage1.sh"
_L2 = f"{R1} scripts/llama_reinforce_plus_train_stage2.sh"
_EM = f"{R1} OpenRLHF-RAG/openrlhf/trainer/ppo_utils/experience_maker.py"
_ARGS = f"{R1} OpenRLHF-RAG/openrlhf/cli/train_ppo_ray.py"
_G = f"{SR1} train_grpo.sh"
_SY = f"{SR1} verl/trainer/config/ppo_trainer.yaml"
_FW = f"{SR1} verl/workers/fsdp_workers.py"
_GEN = f"{SR1} search_r1/llm_agent/generation.py"
_MQ = f"{RAG} RAG-R1/train_ppo_mq.sh"
_AY = f"{RAG} RAG-R1/verl/trainer/config/ppo_trainer.yaml"
_AGEN = f"{RAG} RAG-R1/rag_r1/llm_agent/generation.py"
_HYBRID = "verl/trainer/main_ppo.py:151-165"
_SLEEP = "verl/third_party/vllm/vllm_v_0_6_3/worker.py:283-291"

_SONAR_RETRIEVER = ("Sonar's preset searches Elasticsearch BM25 with a dense (MiniLM) rerank of 50 candidates, no GPU "
                    "index to build")


def _verl_colocated(repo: str, script: str, n: tuple[str, str], tp: str, util: str, offload: str, retriever: Row):
    """The hybrid engine's placement rows (Search-R1's veRL fork, which RAG-R1 ships unchanged)."""
    return (
        Row("cluster.placement", "colocated", f"{repo} {'RAG-R1/' if repo == RAG else ''}{_HYBRID}",
            "veRL's hybrid engine: actor + vLLM, critic and reference in one pool of n_gpus_per_node x nnodes GPUs"),
        Row("learner.num_ranks", 8, f"{script}:{n[0]}", f"trainer.n_gpus_per_node=8 x trainer.nnodes=1 ({n[1]})"),
        Row("rollout.num_workers", 8, f"{script}:{tp}", "one vLLM engine per GPU (tensor_model_parallel_size=1)"),
        Row("rollout.tensor_parallel_size", 1, f"{script}:{tp}"),
        Row("rollout.num_gpus_per_worker", 1.0, f"{script}:{tp}", "the GPU it shares with a learner rank"),
        Row("rollout.vllm_gpu_memory_utilization", 0.6, f"{script}:{util}"),
        Row("rollout.sleep_level", 2, f"{repo} {'RAG-R1/' if repo == RAG else ''}{_SLEEP}",
            "offload_model_weights points the weights at empty host tensors (dropped, not copied); the KV cache "
            "is freed after generation (free_cache_engine)"),
        Row("learner.offload_while_generating", True, f"{script}:{offload}",
            "fsdp_config optimizer_offload, grad_offload (and param_offload) = true",
            caveat=f"veRL also moves the actor's parameters to host memory between phases ({SR1} "
                   "verl/workers/fsdp_workers.py:438-441, 471-473); Sonar keeps its bf16 parameters on the GPU"),
        retriever,
    )

_R1_ALGO = lambda i: (  # noqa: E731  (both stages share the scripts' algorithm flags)
    Row(f"stages.{i}.lr", 2e-6, f"{_L1 if i == 0 else _L2}:27", "--actor_learning_rate"),
    Row(f"stages.{i}.algo.kl_coef", 1e-4, f"{_L1 if i == 0 else _L2}:26", "--init_kl_coef, fixed controller"),
    Row(f"stages.{i}.algo.kl_mode", "reward", f"{_EM}:306-314", "per-token -beta * kl added to the reward"),
    Row(f"stages.{i}.algo.kl_estimator", "k1", f"{R1} OpenRLHF-RAG/openrlhf/models/utils.py:24-36", "log-ratio"),
    Row(f"stages.{i}.algo.clip_low", 0.2, f"{_ARGS}:267", "--eps_clip default"),
    Row(f"stages.{i}.algo.clip_high", 0.2, f"{_ARGS}:267", "symmetric"),
    Row(f"stages.{i}.algo.mini_batches", 4, f"{_L1 if i == 0 else _L2}:24",
        "rollout_batch_size x 16 / train_batch_size (15 x 16 / 60, 65 x 16 / 260)"),
    Row(f"stages.{i}.algo.ppo_epochs", 1, f"{_L1}:62", "--max_epochs 1"),
    Row(f"stages.{i}.algo.loss_agg", "seq_mean_token_mean", f"{R1} OpenRLHF-RAG/openrlhf/models/loss.py:81",
        "token mean per sample (micro_train_batch_size 1), averaged over samples"),
    Row(f"stages.{i}.algo.dynamic_sampling", False, f"{_ARGS}:358-361", "the filter flags are declared, never used"),
    Row(f"stages.{i}.algo.off_policy", "none", f"{R1} OpenRLHF-RAG/openrlhf/trainer/ppo_trainer.py:242-258",
        "synchronous: generate, train, push, clear the buffer; auto resolves to none in sync mode"),
    Row(f"stages.{i}.algo.recompute_old_logprobs", True, f"{_EM}:808-809",
        "make_experience: action_log_probs = self.actor(sequences, ...): the ratio's old policy is the actor's"),
)

_VERL_OPTIMIZER = lambda yaml: (  # noqa: E731  (Search-R1's veRL fork, which RAG-R1 ships unchanged)
    Row("learner.lr_decay", "constant", f"{_FW}:240-241", "constant after warm-up, hard-wired"),
    Row("learner.betas", [0.9, 0.999], f"{_FW}:231", "AdamW defaults"),
    Row("learner.weight_decay", 0.01, f"{_FW}:232"),
    Row("learner.grad_clip", 1.0, f"{yaml}:32"),
)

RECIPES.update({
    "r1_searcher": (
        Row("protocol.name", "r1_searcher", f"{_EM}:1087", "<|begin_of_query|> / <|begin_of_documents|> / <answer>"),
        Row("protocol.rules", "upstream", f"{_EM}:1087-1180", "stop only at <|end_of_query|>; the last query opener"),
        Row("protocol.template", "chat", f"{_L1}:87", "--apply_chat_template"),
        Row("rollout.group_size", 16, f"{_L1}:21", "--n_samples_per_prompt"),
        Row("learner.groups_per_step", 65, f"{_L2}:25", "--rollout_batch_size of stage 2",
            caveat="one value for both stages; stage 1's script takes 15 prompts per batch (350 questions)"),
        *_R1_ALGO(0),
        Row("stages.0.algo.name", "group_norm", f"{_L1}:60", "(r - group mean) / (std + 1e-9), no batch whitening"),
        Row("stages.0.reward.name", "r1_stage1", f"{R1} train/reward_server_llama_stage1.py:156-198"),
        Row("stages.0.reward.variant", "code_llama", f"{R1} train/reward_server_llama_stage1.py:156-198",
            "+-1 cover-EM, +0.5 documents, +0.5 think/answer tags"),
        *_R1_ALGO(1),
        Row("stages.1.algo.name", "reinforce_pp_baseline", f"{_L2}:61", "reinforce_baseline: r - group mean, then whitened"),
        Row("stages.1.reward.name", "r1_stage2", f"{R1} train/reward_server_llama_stage2.py:184-227"),
        Row("stages.1.reward.variant", "code_llama", f"{R1} train/reward_server_llama_stage2.py:184-227"),
        Row("stages.1.reward.format_penalty", -1.0, f"{R1} train/reward_server_llama_stage2.py:227"),
        Row("stages.0.steps", "unbounded", f"{_L1}:22,63", "--num_episodes 10000; runs were stopped by hand",
            differs="a stage needs an end: 20 steps is about 4 passes over stage 1's 350 questions at 65 per step"),
        Row("stages.1.steps", "unbounded", f"{_L2}:22", "--num_episodes 10000",
            differs="250 steps: two passes over stage 2's 8,148 questions at 65 per step"),
        Row("learner.warmup_steps", 0, f"{_L1}:64", "--lr_warmup_ratio 0"),
        Row("learner.lr_decay", "constant", f"{R1} OpenRLHF-RAG/openrlhf/trainer/ray/ppo_actor.py:235-241",
            "cosine_with_min_lr (0.1 lr) over 930,000 scheduled steps: constant to 1e-7 over any real run"),
        Row("learner.betas", [0.9, 0.95], f"{_ARGS}:297", "--adam_betas"),
        Row("learner.weight_decay", 0.0, f"{_ARGS}:265", "--l2"),
        Row("learner.grad_clip", 1.0, f"{_ARGS}:264", "--max_norm"),
        Row("rollout.temperature", 1.0, f"{_EM}:1105", "hard-coded in the retrieval loop"),
        Row("rollout.top_p", 0.95, f"{_EM}:1105", "hard-coded in the retrieval loop (--top_p never reaches it)"),
        Row("protocol.max_new_tokens_per_turn", 512, f"{_EM}:1105", "hard-coded"),
        Row("protocol.max_total_tokens", 30024, f"{_ARGS}:145", "vLLM max_model_len = prompt 1024 + generate 29000"),
        Row("protocol.max_turns", 8, f"{_EM}:1127-1140", "t == 8: the ninth generation cannot search"),
        Row("protocol.max_queries_per_step", 1, f"{_EM}:1143"),
        Row("protocol.docs_per_query", 3, f"{_EM}:1189-1190"),
        Row("retrieval.k", 3, f"{_EM}:1189-1190"),
        Row("protocol.on_invalid", "end", f"{_EM}:1161-1180", "a turn without a query ends the rollout"),
        Row("protocol.max_doc_tokens", "none", f"{_EM}:1197-1207", "documents are not truncated",
            differs="Sonar always caps a document; 512 tokens is far above a wiki-18 passage (100 words)"),
        Row("cluster.mode", "sync", f"{R1} OpenRLHF-RAG/openrlhf/trainer/ppo_trainer.py:242-258", "on-policy"),
        Row("learner.precision", "bf16", f"{_L1}:69"),
        Row("learner.zero_stage", 2, f"{_L1}:68"),
        Row("learner.gradient_checkpointing", True, f"{_L1}:76"),
        Row("cluster.placement", "split", f"{_L1}:43-51",
            "OpenRLHF without --colocate_all_models: the vLLM engine on GPUs of its own, weights over NCCL "
            "(--vllm_sync_backend nccl)"),
        Row("learner.num_ranks", 5, f"{_L1}:48", "--actor_num_gpus_per_node 5; the reference on the same GPUs "
            "(--colocate_actor_ref), as Sonar's KL reference lives in the learner"),
        Row("rollout.num_workers", 1, f"{_L1}:49", "--vllm_num_engines 1"),
        Row("rollout.tensor_parallel_size", 2, f"{_L1}:50", "--vllm_tensor_parallel_size 2"),
        Row("rollout.num_gpus_per_worker", 2.0, f"{_L1}:50", "one GPU per tensor-parallel rank"),
        Row("rollout.vllm_gpu_memory_utilization", 0.9,
            f"{R1} OpenRLHF-RAG/openrlhf/trainer/ray/vllm_engine.py:118-128", "not passed to vllm.LLM: vLLM's default"),
        Row("retrieval.backend", "bge-large-en-v1.5 + FAISS, POST /queries", f"{R1} train/wiki_corpus_load.py:21-84",
            f"its own server ({_EM}:1058,1190: k=3): Wikipedia abstracts (enwiki-20171001, HotpotQA's) or KILT "
            "passages",
            differs=f"{_SONAR_RETRIEVER}; no Sonar backend speaks this server's /queries API (raw corpus lines)"),
    ),
    "search_r1": (
        Row("protocol.name", "search_r1", f"{_GEN}:422-429", "<search> / <information> / <answer>"),
        Row("protocol.rules", "upstream", f"{_GEN}:61-66", "no stop strings: cut at the first </search>, else </answer>"),
        Row("protocol.template", "chat", f"{SR1} verl/utils/dataset/rl_dataset.py:128-131",
            "the chat template whenever the tokenizer has one"),
        Row("protocol.prompt", "search_r1", f"{SR1} scripts/data_process/nq_search.py:32-36"),
        Row("rollout.group_size", 5, f"{_G}:62", "actor_rollout_ref.rollout.n_agent"),
        Row("learner.groups_per_step", 512, f"{_G}:34", "data.train_batch_size"),
        Row("stages.0.algo.mini_batches", 10, f"{_G}:48", "512 x 5 rows / ppo_mini_batch_size 256"),
        Row("stages.0.algo.ppo_epochs", 1, f"{_SY}:39"),
        Row("stages.0.lr", 1e-6, f"{_G}:45"),
        Row("learner.warmup_steps", 286, f"{_G}:46", "lr_warmup_steps_ratio 0.285 x 1005 total steps",
            caveat="Sonar's step s runs at lr (s + 1) / 286; veRL's at s / 286 (its first update at lr 0)"),
        *_VERL_OPTIMIZER(_SY),
        Row("stages.0.steps", 1004, f"{_G}:75", "total_training_steps=1005; the loop ends after 1,004 updates"),
        Row("stages.0.algo.name", "grpo", f"{_G}:41", "(r - mean) / (unbiased std + 1e-6)"),
        Row("stages.0.algo.kl_coef", 1e-3, f"{_G}:59"),
        Row("stages.0.algo.kl_mode", "loss", f"{_G}:47", "use_kl_loss=true"),
        Row("stages.0.algo.kl_estimator", "k3", f"{_G}:60", "low_var_kl"),
        Row("stages.0.algo.kl_clamp", 10.0, f"{SR1} verl/trainer/ppo/core_algos.py:253-268", "clamp(k3, -10, 10)"),
        Row("stages.0.algo.entropy_coef", 1e-3, f"{_SY}:35", "entropy_coeff"),
        Row("stages.0.algo.clip_low", 0.2, f"{_SY}:34"),
        Row("stages.0.algo.clip_high", 0.2, f"{_SY}:34"),
        Row("stages.0.algo.loss_agg", "token_mean", f"{SR1} verl/trainer/ppo/core_algos.py:192",
            "masked mean per micro-batch, / gradient accumulation"),
        Row("stages.0.algo.dynamic_sampling", False, f"{SR1} verl/trainer/ppo/core_algos.py:111-155",
            "equal-reward groups stay (zero advantage)"),
        Row("stages.0.algo.off_policy", "none", f"{SR1} verl/trainer/ppo/ray_trainer.py:729-740",
            "old logprobs recomputed by the actor; auto resolves to none in sync mode"),
        Row("stages.0.algo.recompute_old_logprobs", True, f"{SR1} verl/trainer/ppo/ray_trainer.py:738-740",
            "actor_rollout_wg.compute_log_prob before the update: the ratio's old policy is the actor's, not vLLM's"),
        Row("stages.0.reward.name", "search_r1", f"{SR1} verl/utils/reward_score/qa_em.py:73-110"),
        Row("rollout.temperature", 1.0, f"{_G}:63"),
        Row("rollout.top_p", 0.95, f"{_SY}:71", "the yaml default; the script does not set it"),
        Row("protocol.max_new_tokens_per_turn", 500, f"{_G}:37", "max_response_length"),
        Row("protocol.max_total_tokens", 4096, f"{_G}:36", "max_prompt_length",
            caveat="upstream left-truncates a longer context and goes on; Sonar ends the rollout (max_tokens)"),
        Row("protocol.max_doc_tokens", 500, f"{_G}:39", "max_obs_length: the whole observation",
            differs="Sonar caps each document (166 x 3 documents)"),
        Row("protocol.max_turns", 2, f"{_G}:79", "max_turns; the v0.2 scripts use 4"),
        Row("protocol.max_queries_per_step", 1, f"{_GEN}:422-429"),
        Row("protocol.docs_per_query", 3, f"{_G}:81", "retriever.topk"),
        Row("retrieval.k", 3, f"{_G}:81"),
        Row("protocol.on_invalid", "message", f"{_GEN}:395-401", "My previous action is invalid..."),
        Row("cluster.mode", "sync", f"{SR1} verl/trainer/ppo/ray_trainer.py:695-843", "the hybrid engine: on-policy"),
        Row("learner.gradient_checkpointing", True, f"{_G}:43"),
        *_verl_colocated(SR1, _G, ("69-70", "8 GPUs of one node"), "54", "56", "50-52", Row(
            "retrieval.backend", "http", f"{SR1} retrieval_launch.sh:3-13",
            "search_r1/search/retrieval_server.py: e5-base-v2 + a FAISS Flat index of wiki-18 on GPU, POST /retrieve",
            differs=f"{_SONAR_RETRIEVER}; retrieval.backend=http retrieval.rerank=none (retrieval.http.url, default "
                    "http://127.0.0.1:8000/retrieve) searches upstream's server unchanged")),
    ),
    "rag_r1": (
        Row("protocol.name", "rag_r1_multi", f"{_AGEN}:474-475", "comma-separated queries in one <search>"),
        Row("protocol.rules", "upstream", f"{_AGEN}:64-69", "no stop strings: cut at the first </search>, else </answer>"),
        Row("protocol.template", "chat", f"{RAG} RAG-R1/verl/utils/dataset/rl_dataset.py:128-131"),
        Row("protocol.prompt", "rag_r1", f"{RAG} RAG-R1/scripts/data_process/hotpotqa_search_mq.py:35"),
        Row("rollout.group_size", 1, f"{_MQ}:43", "n_agent=1"),
        Row("learner.groups_per_step", 512, f"{_MQ}:19"),
        Row("stages.0.algo.mini_batches", 4, f"{_MQ}:32", "512 / ppo_mini_batch_size 128"),
        Row("stages.0.algo.ppo_epochs", 1, f"{_AY}:39"),
        Row("stages.0.lr", 1e-6, f"{_MQ}:28"),
        Row("critic.lr", 1e-5, f"{_MQ}:46",
            caveat="constant; upstream warms the critic's lr up over int(0.015 x 500) = 7 steps"),
        Row("learner.warmup_steps", 142, f"{_MQ}:31", "0.285 x 500 total steps",
            caveat="Sonar's step s runs at lr (s + 1) / 142; veRL's at s / 142 (its first update at lr 0)"),
        *_VERL_OPTIMIZER(_AY),
        Row("stages.0.steps", 499, f"{_MQ}:69", "total_training_steps=500: 499 updates"),
        Row("stages.0.algo.name", "ppo", f"{_MQ}:26", "adv_estimator=gae"),
        Row("stages.0.algo.kl_coef", 1e-3, f"{_MQ}:55"),
        Row("stages.0.algo.kl_mode", "reward", f"{SR1} verl/trainer/ppo/ray_trainer.py:792-796", "apply_kl_penalty"),
        Row("stages.0.algo.kl_estimator", "k1", f"{_AY}:157", "kl_penalty: kl"),
        Row("stages.0.algo.entropy_coef", 1e-3, f"{_AY}:35"),
        Row("stages.0.algo.clip_low", 0.2, f"{_AY}:34"),
        Row("stages.0.algo.clip_high", 0.2, f"{_AY}:34"),
        Row("stages.0.algo.off_policy", "none", f"{SR1} verl/trainer/ppo/ray_trainer.py:729-740",
            "auto resolves to none in sync mode"),
        Row("stages.0.algo.recompute_old_logprobs", True, f"{RAG} RAG-R1/verl/trainer/ppo/ray_trainer.py:738-740",
            "actor_rollout_wg.compute_log_prob before the update: the ratio's old policy is the actor's, not vLLM's"),
        Row("critic.value_clip", 0.5, f"{_AY}:126", "cliprange_value"),
        Row("critic.gamma", 1.0, f"{_AY}:150"),
        Row("critic.lam", 1.0, f"{_AY}:151"),
        Row("critic.whiten", True, f"{SR1} verl/trainer/ppo/core_algos.py:106", "masked_whiten"),
        Row("critic.tokens", "response", f"{SR1} verl/trainer/ppo/ray_trainer.py:130-131",
            "attention_mask over the response, documents included"),
        Row("critic.warmup_steps", 0, f"{_MQ}:57"),
        Row("stages.0.reward.name", "rag_r1", f"{SR1} verl/utils/reward_score/qa_em.py:73-110", "Search-R1's file"),
        Row("rollout.temperature", 1.0, f"{_MQ}:44"),
        Row("rollout.top_p", 0.95, f"{_AY}:71", "the yaml default; the script does not set it"),
        Row("protocol.max_new_tokens_per_turn", 500, f"{_MQ}:22"),
        Row("protocol.max_total_tokens", 8192, f"{_MQ}:21",
            caveat="upstream left-truncates a longer context and goes on; Sonar ends the rollout (max_tokens)"),
        Row("protocol.max_doc_tokens", 1000, f"{_MQ}:24", "max_obs_length: each query's documents string",
            differs="Sonar caps each document (333 x 3 documents)"),
        Row("protocol.max_turns", 5, f"{_MQ}:72"),
        Row("protocol.max_queries_per_step", "none", f"{_AGEN}:474-475", "every non-empty comma-separated part",
            differs="Sonar bounds one step's retrieval batch at 16 (the prompt asks for up to three)"),
        Row("protocol.docs_per_query", 3, f"{_MQ}:74"),
        Row("retrieval.k", 3, f"{_MQ}:74"),
        Row("protocol.on_invalid", "message", f"{_AGEN}:420-426"),
        Row("cluster.mode", "sync", f"{SR1} verl/trainer/ppo/ray_trainer.py:695-843"),
        Row("learner.gradient_checkpointing", True, f"{_MQ}:42"),
        *_verl_colocated(RAG, _MQ, ("62-63", "8 GPUs of one node"), "38", "40", "34-36,52-54", Row(
            "retrieval.backend", "http", f"{RAG} RAG-R1/start_retrieval.py:58-121",
            "bge-large-en-v1.5 + a FAISS Flat (inner product) index of KILT's Wikipedia in 100-word passages, "
            "sharded over the GPUs, POST /retrieve (Search-R1's API)",
            differs=f"{_SONAR_RETRIEVER}; retrieval.backend=http retrieval.rerank=none (retrieval.http.url) searches "
                    "upstream's server unchanged")),
    ),
})

GPUS = {
    "r1_searcher": (7, "5 for the actor and reference ranks, 2 for one vLLM engine of TP 2 (split), of the node's 8 "
                       "(CUDA_VISIBLE_DEVICES=0-7)", f"{_L1}:20,45-51"),
    "search_r1": (8, "one node, each GPU an actor rank and its vLLM engine (veRL's hybrid engine, colocated)",
                  f"{_G}:69-70"),
    "rag_r1": (8, "one node, each GPU an actor and critic rank and its vLLM engine (veRL's hybrid engine, colocated)",
               f"{_MQ}:62-63"),
}
"""GPUs upstream's script places its training on, how, and where the script says so (the presets ask for as
many: ``tests/cluster/test_recipes.py``)."""

MODELS = {
    "r1_searcher": ("Meta-Llama-3.1-8B-Instruct (stage 2 starts from stage 1)", f"{_L1}:19"),
    "search_r1": ("Qwen/Qwen2.5-3B (the v0.2 scripts: Qwen2.5-7B)", f"{_G}:15"),
    "rag_r1": ("Qwen2.5-7B-Instruct after RAG-R1's SFT (LLaMA-Factory, outside the repository)", f"{_MQ}:8"),
}
"""The model each recipe's script trains, and where it says so (``model.path`` is the user's)."""
