"""The dimensions of a configured size's model (its Arch), read without network: a scratch
model's from its config and our tokenizer, a GGUF file's from its header, a hub model's from the
table of known architectures. Used by the memory plan (stages.plan) and the cost plan
(stages.cost); errors are ConfigErrors that name the key."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from stages.core.common.errors import ConfigError

if TYPE_CHECKING:  # the config sits above the library: types only
    from stages.config import Config


# DeepSpeed 0.19.8's stage3_param_persistence_threshold as our ds_config sets it (memory.py has
# the other DeepSpeed defaults).
PERSISTENCE_THRESHOLD = 0
"""stage3_param_persistence_threshold of our ds_config (DeepSpeed's default 1e5 would keep every
parameter of at most that many elements whole on every rank; ours partitions them all)."""


@dataclass(frozen=True)
class Arch:
    """The dimensions of a decoder-only model that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    max_positions: int = 32768
    source: str = ""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def tensors(self) -> list[tuple[str, int]]:
        """(module, elements) of every parameter tensor, a tied head counted once."""
        d, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        out = [("embed_tokens", self.vocab * d)]
        for n in range(self.layers):
            layer = [("q_proj", d * q), ("k_proj", d * kv), ("v_proj", d * kv), ("o_proj", q * d),
                     ("gate_proj", d * i), ("up_proj", d * i), ("down_proj", i * d),
                     ("input_layernorm", d), ("post_attention_layernorm", d)]
            if self.qkv_bias:
                layer += [("q_proj.bias", q), ("k_proj.bias", kv), ("v_proj.bias", kv)]
            if self.qk_norm:
                layer += [("q_norm", self.head_dim), ("k_norm", self.head_dim)]
            out += [(f"layers.{n}.{name}", size) for name, size in layer]
        out.append(("norm", d))
        if not self.tied:
            out.append(("lm_head", self.vocab * d))
        return out

    @property
    def params(self) -> int:
        """Parameters (elements), a tied head once."""
        return sum(n for _, n in self.tensors())

    @property
    def largest_layer(self) -> int:
        """Elements of the largest module's own parameters (DeepSpeed's largest_layer_params:
        weight and bias of one Linear; here the embedding or the untied head)."""
        per_module: dict[str, int] = {}
        for name, n in self.tensors():
            key = name.removesuffix(".bias")
            per_module[key] = per_module.get(key, 0) + n
        return max(per_module.values())

    def persistent(self, threshold: int = PERSISTENCE_THRESHOLD) -> int:
        """Elements of the parameters ZeRO-3 keeps whole on every rank (numel <= threshold)."""
        return sum(n for _, n in self.tensors() if n <= threshold) if threshold else 0


# Public config.json values (architecture fields only). Sources, read through public copies:
# - Qwen2.5-0.5B: huggingface.co/osllmai-community/Qwen2.5-0.5B config.json (_name_or_path
#   Qwen/Qwen2.5-0.5B) and a "Qwen/Qwen2.5-0.5B model config" page: 896 / 24 / 14 / 2 / 4864 /
#   151936, tied, max_position_embeddings 32768.
# - Qwen2.5-1.5B: huggingface.co/kaitchup/Qwen2.5-1.5B-AutoRound-GPTQ-asym-4bit config.json
#   (_name_or_path Qwen/Qwen2.5-1.5B): 1536 / 28 / 12 / 2 / 8960 / 151936, tied, 131072.
# - Qwen2.5-7B: github citsjtu2020/LLM-Prof sglang/Model_Config.md ("Qwen2.5-7B") and
#   huggingface.co/Time-Reasoning/qwen2.5-7B-rat config.json: 3584 / 28 / 28 / 4 / 18944 /
#   152064, untied, 131072.
# - Qwen3-8B-Base: github Chen-Oliver/qwen3-8b-base config.json: 4096 / 36 / 32 / 8 / head_dim
#   128 / 12288 / 151936, untied, 32768.
# - Qwen3-14B-Base, Qwen3-32B-Base: the same family's post-trained Qwen3-14B and Qwen3-32B in
#   citsjtu2020/LLM-Prof sglang/Model_Config.md (5120 / 40 / 40 / 8 / 128 / 17408 and 5120 / 64 /
#   64 / 8 / 128 / 25600, vocabulary 151936, untied; the base checkpoints share the architecture
#   and, as Qwen3-8B-Base, have 32768 positions rather than the post-trained 40960).
# Qwen2.5 has biases on q/k/v; Qwen3 has none and normalises q and k per head.
HUB_ARCHS: dict[str, Arch] = {
    "Qwen/Qwen2.5-0.5B": Arch(896, 24, 14, 2, 64, 4864, 151936, tied=True, qkv_bias=True,
                              max_positions=32768, source="table: Qwen/Qwen2.5-0.5B config.json"),
    "Qwen/Qwen2.5-1.5B": Arch(1536, 28, 12, 2, 128, 8960, 151936, tied=True, qkv_bias=True,
                              max_positions=131072, source="table: Qwen/Qwen2.5-1.5B config.json"),
    "Qwen/Qwen2.5-7B": Arch(3584, 28, 28, 4, 128, 18944, 152064, tied=False, qkv_bias=True,
                            max_positions=131072, source="table: Qwen/Qwen2.5-7B config.json"),
    "Qwen/Qwen3-8B-Base": Arch(4096, 36, 32, 8, 128, 12288, 151936, tied=False, qk_norm=True,
                               max_positions=32768, source="table: Qwen/Qwen3-8B-Base config.json"),
    "Qwen/Qwen3-14B-Base": Arch(5120, 40, 40, 8, 128, 17408, 151936, tied=False, qk_norm=True,
                                max_positions=32768, source="table: Qwen/Qwen3-14B config.json"),
    "Qwen/Qwen3-32B-Base": Arch(5120, 64, 64, 8, 128, 25600, 151936, tied=False, qk_norm=True,
                                max_positions=32768, source="table: Qwen/Qwen3-32B config.json"),
}
PUBLISHED_PARAMS = {"Qwen/Qwen2.5-0.5B": 0.49e9, "Qwen/Qwen2.5-1.5B": 1.54e9,
                    "Qwen/Qwen2.5-7B": 7.6e9, "Qwen/Qwen3-8B-Base": 8.2e9,
                    "Qwen/Qwen3-14B-Base": 14.8e9, "Qwen/Qwen3-32B-Base": 32.8e9}
"""The model cards' parameter totals (tests/test_plan.py checks Arch.params against them)."""


class UnknownModel(LookupError):
    """No dimensions for a hub model: neither in HUB_ARCHS nor in the local Hugging Face cache."""


def arch_from_hf_config(raw: dict, source: str) -> Arch:
    """An Arch from a Hugging Face config.json mapping (Qwen2/Qwen3/Llama-style fields)."""
    raw = raw.get("text_config", raw)
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    model_type = raw.get("model_type", "")
    return Arch(hidden=hidden, layers=raw["num_hidden_layers"], heads=heads,
                kv_heads=raw.get("num_key_value_heads") or heads,
                head_dim=raw.get("head_dim") or hidden // heads,
                intermediate=raw["intermediate_size"], vocab=raw["vocab_size"],
                tied=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
                qk_norm=model_type.startswith("qwen3"),
                max_positions=raw.get("max_position_embeddings", 32768), source=source)


def hub_cache_dirs() -> list[Path]:
    """Where a local Hugging Face hub cache may be (HF_HUB_CACHE, HF_HOME/hub, ~/.cache)."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def cached_hf_config(model_id: str, revision: str = "main") -> Path | None:
    """config.json of `model_id` in a local hub cache (the revision's snapshot, else any)."""
    for cache in hub_cache_dirs():
        repo = cache / f"models--{model_id.replace('/', '--')}"
        if not repo.is_dir():
            continue
        ref = repo / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
        for snap in [repo / "snapshots" / commit, *sorted((repo / "snapshots").glob("*"))]:
            if (snap / "config.json").is_file():
                return snap / "config.json"
    return None


def hub_arch(model_id: str, revision: str = "main") -> Arch:
    """Dimensions of a hub model: the built-in table, else a local cache's config.json."""
    if model_id in HUB_ARCHS:
        return HUB_ARCHS[model_id]
    local = Path(model_id).expanduser() / "config.json"  # a local folder in Hugging Face layout
    path = local if local.is_file() else cached_hf_config(model_id, revision)
    if path is not None:
        return arch_from_hf_config(json.loads(path.read_text()), f"cache: {path}")
    raise UnknownModel(
        f"no dimensions for hub model {model_id!r}: add its config.json values (hidden_size, "
        "num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size, "
        "vocab_size, tie_word_embeddings) to stages.core.plans.memory.HUB_ARCHS, or put its config.json "
        f"in a local Hugging Face cache (huggingface-cli download {model_id} config.json)")


def scratch_arch(arch, vocab: int) -> Arch:
    """A scratch model's Arch from its config.ScratchArch (Qwen2 with tied embeddings, q/k/v
    biases) and the tokenizer's size (stages.core.models.modeling.build_tokenizer)."""
    return Arch(arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads,
                arch.num_key_value_heads, arch.hidden_size // arch.num_attention_heads,
                arch.intermediate_size, vocab, tied=True, qkv_bias=True,
                max_positions=arch.max_position_embeddings, source="scratch")


def gguf_arch(path: str | Path) -> Arch:
    """Dimensions from a GGUF file's metadata (the `gguf` package; Llama-family keys)."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def value(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    kind = value("general.architecture")
    hidden, heads = value(f"{kind}.embedding_length"), value(f"{kind}.attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = value(f"{kind}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return Arch(hidden, value(f"{kind}.block_count"), heads,
                value(f"{kind}.attention.head_count_kv") or heads,
                value(f"{kind}.attention.key_length") or hidden // heads,
                value(f"{kind}.feed_forward_length"), vocab, tied="output.weight" not in names,
                qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
                max_positions=value(f"{kind}.context_length") or 2048, source=f"gguf: {path}")


# ---------------------------------------------------------------------------------------------
# A configured size
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def tokenizer_size() -> int:
    from stages.core.models.modeling import build_tokenizer

    return len(build_tokenizer())


def model_arch(cfg: Config, size: str) -> Arch:
    """The dimensions of a size's model, without network; errors name the config key."""
    m = cfg.models[size]
    if m.source == "scratch":
        return scratch_arch(m.scratch, tokenizer_size())
    if m.source == "gguf":
        from stages.core.models.modeling import GgufNotFound, find_gguf

        try:
            path, _, _ = find_gguf(m.gguf.package, m.gguf.file)
        except GgufNotFound as err:
            raise ConfigError(f"models.{size}.gguf.{err.field}: {err}") from None
        return gguf_arch(path)
    try:
        return hub_arch(m.hub.model_id, m.hub.commit or m.hub.revision)  # the locked snapshot
    except UnknownModel as err:
        raise ConfigError(f"models.{size}.hub.model_id: {err}") from None
