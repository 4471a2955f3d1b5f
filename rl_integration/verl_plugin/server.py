"""The spectail rollout server: one Ray actor per replica node, holding one spectail Engine.

It answers what verl asks of a rollout server (verl's `vLLMHttpServer`,
verl/workers/rollout/vllm_rollout/vllm_async_server.py): `generate` (token in, token out, the
exact logprobs when asked, verl's spec counts in extra_fields), memory (`sleep` / `wake_up`,
KV-cache release and resume), aborts, and `update_weights` (docs/verl.md, "What the server does").
Methods verl calls that have nothing to do here are kept as no-ops.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rollout import Engine, cpu
from rollout.core.request import check_ids

from .batcher import Batcher
from .options import check_parallelism, engine_config, max_model_len, server_options
from .sampling import SeedBook, to_sampling_params


@dataclass
class Pending:
    request_id: str
    prompt_ids: list[int]
    params: Any
    seed: int
    group: str
    logprobs: bool


class SpectailServer:
    def __init__(self, config, model_config, rollout_mode, workers=None, replica_rank: int = 0, node_rank: int = 0,
                 gpus_per_node: int = 1, nnodes: int = 1, cuda_visible_devices: Optional[str] = None):
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        cpu.configure()  # this actor's process is spectail's: the oneDNN cap before the engine's first kernel

        if cuda_visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        check_parallelism(self.config)
        self.options = server_options(self.config)
        self.rollout_mode, self.replica_rank, self.node_rank = rollout_mode, replica_rank, node_rank
        self.device = self.options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.engine = Engine.from_pretrained(self.model_config.local_path,
                                             engine_config(self.config, self.options, self.device))
        self.max_model_len = max_model_len(self.config)
        self.stop_token_ids = eos_ids(self.model_config)
        self.seeds = SeedBook(self.config.seed, replica_rank)
        self.seeds.set_step(0)
        self.global_steps: Optional[int] = None
        self.weight_version = 0
        self.cancelled: set[str] = set()
        self.offloaded = False  # weights moved to the host by sleep()
        self.paused, self.rejecting = False, False
        self._batcher: Optional[Batcher] = None
        self._resume: Optional[asyncio.Event] = None

    def ready(self) -> dict:
        return {"vocab_size": self.engine.vocab_size, "device": self.device, "max_model_len": self.max_model_len}

    @property
    def batcher(self) -> Batcher:
        if self._batcher is None:  # made inside the actor's event loop
            self._batcher = Batcher(self._run_batch, self._aborted, self.options.gather_window_s,
                                    self.options.max_gather_s)
            self._resume = asyncio.Event()
            self._resume.set()
        return self._batcher

    # ---- generation ----------------------------------------------------------------------

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, priority: int = 0,
                       spectail_group: Optional[str] = None, **kwargs):
        if image_data or video_data or audio_data or mm_processor_kwargs:
            raise ValueError("spectail's rollout server takes text prompts only (no image / video / audio data)")
        extra = sorted(k for k, v in kwargs.items() if v is not None)
        if extra:
            raise ValueError(f"spectail's rollout server does not take {extra}")
        prompt = check_ids(list(prompt_ids), self.engine.vocab_size, "prompt_ids")
        if not prompt:
            raise ValueError("prompt_ids is empty")
        params, logprobs = to_sampling_params(dict(sampling_params), self.config, len(prompt), self.max_model_len,
                                              self.stop_token_ids)
        batcher = self.batcher
        while self.paused:  # behind an abort: wait for resume_generation, or be refused
            if self.rejecting:
                return self._aborted(None)
            await self._resume.wait()
        seed = self.seeds.seed_for(prompt, grouped=spectail_group is not None)
        group = str(spectail_group if spectail_group is not None else request_id)
        return await batcher.submit(Pending(str(request_id), prompt, params, seed, group, logprobs))

    def _run_batch(self, items: list[Pending], stopping) -> list:
        """One engine run over a batch (on the engine thread)."""
        self._awake(kv=True, weights=True)
        group_ids = {g: i for i, g in enumerate(dict.fromkeys(p.group for p in items))}
        requests = self.engine.make_requests([p.prompt_ids for p in items], [p.params for p in items],
                                             [p.seed for p in items], groups=[group_ids[p.group] for p in items])
        batch = self.batcher.batches
        todo = list(requests)
        try:
            while todo and not stopping():
                self.engine.run(todo, max_new_tokens=self.options.abort_chunk_tokens)
                todo = [r for r, p in zip(requests, items)
                        if r.finish_reason is None and p.request_id not in self.cancelled]
        finally:
            self.engine.release_groups(set(group_ids.values()))
            self.cancelled.difference_update(p.request_id for p in items)
        return [self._output(r, p, batch) for r, p in zip(requests, items)]

    def _output(self, req, item: Pending, batch: int):
        from verl.workers.rollout.replica import TokenOutput

        c = req.completion()
        done = req.finish_reason is not None
        extra = {"global_steps": self.global_steps, "spectail_seed": item.seed, "spectail_batch": batch,
                 "spectail_replica": self.replica_rank,
                 "spectail_finish_reason": c.finish_reason if done else "abort",
                 "spec_num_draft_tokens": int(sum(c.stats["proposed"].values())),
                 "spec_num_accepted_tokens": int(sum(c.stats["accepted"].values())),
                 "spec_num_verify_steps": int(c.stats["forward_passes"])}
        return TokenOutput(token_ids=c.token_ids, log_probs=list(c.logprobs) if item.logprobs else None,
                           stop_reason="completed" if done else "aborted", num_preempted=0, extra_fields=extra)

    def _aborted(self, item: Optional[Pending]):
        from verl.workers.rollout.replica import TokenOutput

        return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted",
                           extra_fields={"global_steps": self.global_steps})

    # ---- aborts --------------------------------------------------------------------------

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        batcher = self.batcher
        self.paused, self.rejecting = True, bool(reject_request)
        self._resume.clear()
        count = batcher.abort()
        async with batcher.engine_lock:  # the running batch has answered
            pass
        return {"aborted_count": count, "request_ids": []}

    async def resume_generation(self) -> None:
        self.batcher  # noqa: B018 -- makes the gate
        self.paused, self.rejecting = False, False
        self._resume.set()

    async def resume_engine_generation(self) -> None:
        pass

    async def open_submission_gate(self) -> None:
        await self.resume_generation()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        batcher = self.batcher
        for item in list(batcher.queue):
            if item.payload.request_id == str(request_id):
                batcher.queue.remove(item)
                item.future.set_result(self._aborted(item.payload))
                return {"aborted": True, "request_id": request_id}
        self.cancelled.add(str(request_id))  # if it is running: stops at its next chunk boundary
        return {"aborted": batcher.running > 0, "request_id": request_id}

    async def wait_for_requests_to_drain(self) -> None:
        batcher = self.batcher
        while batcher.queue or batcher.running:
            await asyncio.sleep(0.01)

    # ---- memory --------------------------------------------------------------------------

    async def sleep(self) -> None:
        """Free the device memory for training: the KV cache, and in hybrid mode on an
        accelerator the weights too (moved to the host)."""
        if self.config.free_cache_engine:
            offload = self.device != "cpu" and getattr(self.rollout_mode, "value", self.rollout_mode) == "hybrid"
            await self.batcher.call(self._release, True, offload)

    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        await self.batcher.call(self._awake, "kv_cache" in tags, "weights" in tags)

    async def release_kv_cache(self) -> None:
        if self.config.free_cache_engine:
            await self.batcher.call(self._release, True, False)

    async def resume_kv_cache(self) -> None:
        await self.batcher.call(self._awake, True, False)

    async def clear_kv_cache(self) -> None:
        pass  # no prefix cache: every batch prefills its prompts afresh

    def _release(self, kv: bool, weights: bool) -> None:
        if kv:
            self.engine.cache = None
        if weights and not self.offloaded:
            self.engine.model.to("cpu")
            self.offloaded = True
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def _awake(self, kv: bool, weights: bool) -> None:
        if weights and self.offloaded:
            self.engine.model.to(self.device)
            self.offloaded = False
        if kv and self.engine.cache is None:
            cfg = self.engine.config
            self.engine.cache = self.engine.model.new_cache(cfg.max_batch_size, cfg.max_model_len)

    # ---- weights -------------------------------------------------------------------------

    async def update_weights(self, weights: dict, global_steps: Optional[int] = None) -> int:
        """Load Hugging Face-named tensors (all or nothing); the next rollout draws fresh noise."""
        loaded = await self.batcher.call(self._load, weights)
        self.weight_version += 1
        await self.set_global_steps(global_steps)
        return loaded

    def _load(self, weights: dict) -> int:
        self._awake(kv=False, weights=True)
        return self.engine.update_weights(weights)

    async def set_global_steps(self, global_steps: Optional[int]) -> None:
        if global_steps is not None:
            self.global_steps = int(global_steps)
        self.seeds.set_step(self.global_steps if self.global_steps is not None else self.weight_version)

    # ---- for tests and tools -------------------------------------------------------------

    async def state(self) -> dict:
        p = self.engine.model.lm_head.weight
        return {"kv_cache": self.engine.cache is not None, "weights_device": str(p.device),
                "batches": self.batcher.batches, "running": self.batcher.running, "queued": len(self.batcher.queue),
                "step": self.seeds.step, "paused": self.paused}

    async def start_profile(self, **kwargs) -> None:
        pass

    async def stop_profile(self) -> None:
        pass


def eos_ids(model_config) -> list[int]:
    """Stop tokens as verl's vLLM server gets them: the generation config's, else the tokenizer's."""
    ids: list[int] = []
    for source in (getattr(model_config, "generation_config", None), getattr(model_config, "hf_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.extend([eos] if isinstance(eos, int) else list(eos))
            break
    tok = getattr(model_config, "tokenizer", None)
    if not ids and getattr(tok, "eos_token_id", None) is not None:
        ids.append(tok.eos_token_id)
    return sorted({int(i) for i in ids})
