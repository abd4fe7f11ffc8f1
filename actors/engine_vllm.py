"""vLLM generation engine (GPU only) behind the same ``Engine`` interface as ``HFEngine``.

NOT EXERCISED ON THE MACHINES SONAR IS DEVELOPED ON: they have no GPU and vLLM is GPU-only. The code
follows vLLM's public V1 API (``LLM``, ``SamplingParams``, ``TokensPrompt``, ``collective_rpc`` with a
``worker_extension_cls``) and keeps the same contract as ``HFEngine``:

- token ids in, token ids and *sampling* logprobs out: ``logprobs_mode="processed_logprobs"`` with
  ``top_k=-1`` and ``top_p=1`` reports log_softmax(logits / T), the number the learner recomputes;
- generation stops on ``stop_token_ids`` and the stop token is kept in the output
  (``include_stop_str_in_output`` semantics for ids: vLLM returns the stop id as the last token);
- ``load_weights(named_tensors, version)`` pushes tensors by name into every vLLM worker through
  ``collective_rpc`` (the worker extension calls the model's own ``load_weights``, which handles
  fused/sharded layouts), never while a ``generate`` call runs.
"""
from __future__ import annotations

import threading
from typing import Iterable, Sequence

import numpy as np
import torch

from sonar.actors.engine import Generation, ParamSpec, SamplingParams, resolve_caps


class SonarWorkerExtension:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``); runs inside each vLLM worker process."""

    def sonar_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        device = next(self.model_runner.model.parameters()).device
        self.model_runner.model.load_weights(weights=[(n, t.to(device)) for n, t in named])
        return len(named)


class VLLMEngine:
    def __init__(self, model_dir: str, *, gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16",
                 max_model_len: int | None = None, seed: int = 0):
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, seed=seed, enable_prefix_caching=True,
                       logprobs_mode="processed_logprobs",
                       worker_extension_cls="sonar.actors.engine_vllm.SonarWorkerExtension")
        self.version = 0
        self._lock = threading.Lock()
        self._specs = self._read_specs(model_dir)
        self.model = None  # weights live in the vLLM workers; checksums come from the learner's push

    @classmethod
    def from_model(cls, model, tokenizer, cfg) -> "VLLMEngine":
        if not cfg.model.path:
            raise ValueError("rollout.engine='vllm' needs model.path (a local Hugging Face directory)")
        return cls(cfg.model.path, max_model_len=cfg.protocol.max_total_tokens, seed=cfg.run.seed)

    @staticmethod
    def _read_specs(model_dir: str) -> list[ParamSpec]:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))
        return [ParamSpec(n, tuple(p.shape), torch.bfloat16) for n, p in m.named_parameters()]

    def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams,
                 max_new_tokens_per_prompt: Sequence[int] | None = None) -> list[Generation]:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        caps = resolve_caps(params, len(prompts), max_new_tokens_per_prompt)
        sps = [VSP(temperature=params.temperature, top_p=params.top_p, top_k=-1, max_tokens=max(1, c),
                   stop_token_ids=list(params.stop_token_ids), logprobs=0, seed=params.seed,
                   skip_special_tokens=False) for c in caps]
        with self._lock:
            version = self.version
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], sps,
                                     use_tqdm=False)
        result = []
        for out in outs:
            o = out.outputs[0]
            ids = np.asarray(o.token_ids, dtype=np.int32)
            lps = np.asarray([next(iter(d.values())).logprob if d else 0.0 for d in (o.logprobs or [])],
                             dtype=np.float32)[: len(ids)]
            stop = int(ids[-1]) if len(ids) and int(ids[-1]) in params.stop_token_ids else None
            result.append(Generation(ids, lps, "stop" if stop is not None else "length", version, stop))
        return result

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = [(n, t.detach().cpu()) for n, t in named_tensors]
        with self._lock:
            self.llm.collective_rpc("sonar_load_weights", args=(named,))
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
            self.version = version

    def parameter_specs(self) -> list[ParamSpec]:
        return list(self._specs)

    def state_checksum(self) -> float:
        raise NotImplementedError("vLLM keeps weights in its workers; compare versions, or checksum on the learner")
