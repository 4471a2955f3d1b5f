"""The spectail server's settings: verl's rollout config plus `engine_kwargs.spectail`
(`ServerOptions`' fields: proposers, max_draft_tokens, max_batch_size, dtype, device,
gather_window_s, max_gather_s, abort_chunk_tokens, num_cpus, ...; docs/verl.md). Unknown keys and
wrong types raise ValueError naming them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rl_integration.config import from_dict

KNOWN_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16", "half": "float16", "float64": "float64"}


@dataclass
class ServerOptions:
    proposers: list[str] = field(default_factory=lambda: ["suffix", "lookahead"])
    max_draft_tokens: int = 24
    min_draft_prob: Optional[float] = None
    max_batch_size: int = 128
    dtype: Optional[str] = None
    device: Optional[str] = None
    num_threads: Optional[int] = None
    gather_window_s: float = 0.05
    max_gather_s: float = 2.0
    abort_chunk_tokens: int = 512
    num_cpus: float = 1.0

    def validate(self) -> None:
        if self.gather_window_s < 0 or self.max_gather_s < self.gather_window_s:
            raise ValueError("engine_kwargs.spectail needs 0 <= gather_window_s <= max_gather_s, got "
                             f"{self.gather_window_s}, {self.max_gather_s}")
        if self.abort_chunk_tokens < 1:
            raise ValueError(f"engine_kwargs.spectail.abort_chunk_tokens must be >= 1, got {self.abort_chunk_tokens}")
        if self.num_cpus < 0:
            raise ValueError(f"engine_kwargs.spectail.num_cpus must be >= 0, got {self.num_cpus}")


def server_options(rollout_config) -> ServerOptions:
    """The `engine_kwargs.spectail` mapping of a verl RolloutConfig, checked."""
    kwargs = getattr(rollout_config, "engine_kwargs", None) or {}
    raw = kwargs.get("spectail") or {}
    if hasattr(raw, "items"):
        raw = {k: _plain(v) for k, v in raw.items()}
    options = from_dict(ServerOptions, raw, "actor_rollout_ref.rollout.engine_kwargs.spectail")
    options.validate()
    return options


def check_parallelism(rollout_config) -> None:
    """spectail's engine runs on one device per replica: no tensor / pipeline / data parallelism."""
    sizes = {k: int(getattr(rollout_config, k, 1) or 1) for k in
             ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")}
    bad = {k: v for k, v in sizes.items() if v != 1}
    if bad:
        raise ValueError(f"rollout.name=spectail runs one engine per device: set "
                         f"{', '.join(f'actor_rollout_ref.rollout.{k}=1' for k in bad)} (got {bad})")


def max_model_len(rollout_config) -> int:
    return int(rollout_config.max_model_len or rollout_config.prompt_length + rollout_config.response_length)


def engine_config(rollout_config, options: ServerOptions, device: str):
    from rollout import EngineConfig, SpecConfig

    dtype = options.dtype or str(rollout_config.dtype)
    if dtype not in KNOWN_DTYPES:
        raise ValueError(f"rollout dtype {dtype!r} is not one of {sorted(KNOWN_DTYPES)}")
    spec = None if not options.proposers else SpecConfig(
        proposers=tuple(options.proposers), max_draft_tokens=options.max_draft_tokens,
        min_draft_prob=options.min_draft_prob)
    return EngineConfig(max_batch_size=options.max_batch_size, max_model_len=max_model_len(rollout_config),
                        max_num_batched_tokens=int(rollout_config.max_num_batched_tokens),
                        dtype=KNOWN_DTYPES[dtype], device=device, spec=spec, num_threads=options.num_threads)


def _plain(value: Any) -> Any:
    """OmegaConf containers to Python lists / dicts."""
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value
