"""The tiny model's tokenizer and the base-model reference."""

from __future__ import annotations

import json
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.core.common.io import ArtifactError
from stages.core.models.modeling import (
    EOS,
    build_tokenizer,
    load_model_and_tokenizer,
    load_reference,
)
from tests.conftest import tiny_model

TEXTS = [
    "Q: 1-4+3*7=? A: 3*7=21, 1-4=-3, -3+21=18. #### 18",
    "  leading spaces, trailing  ",
    "tabs\tnewlines\nand ünïcödé ✓ \\boxed{\\frac{1}{2}}",
    f"text{EOS}after special",
]
ARCH = types.SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    tok, model = tiny_model(d, ARCH)
    return d / "checkpoint", tok, model


def test_every_byte_is_one_token():
    tok = build_tokenizer()
    assert len(tok) == 256 + 3
    assert tok("A")["input_ids"] == [ord("A")] and tok(" ")["input_ids"] == [32]
    assert tok("é")["input_ids"] == list("é".encode())
    assert tok.eos_token == tok.pad_token == EOS and tok.bos_token is None


def test_autotokenizer_reproduces_training_ids(saved):
    folder, tok, _ = saved
    auto = AutoTokenizer.from_pretrained(folder)
    assert type(auto).__name__ == "Qwen2Tokenizer"  # the trap: it is rebuilt as Qwen's
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert auto(text, add_special_tokens=False)["input_ids"] == ids
        assert auto.decode(ids) == text
    assert auto.eos_token_id == tok.eos_token_id == auto.pad_token_id


def test_model_round_trips_bit_identically(saved):
    folder, _, model = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_load_through_the_reference(saved):
    folder, tok, model = saved
    loaded, auto = load_model_and_tokenizer(folder.parent / "base.json")
    ids = torch.tensor([tok(TEXTS[0])["input_ids"]])
    assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)
    assert auto.padding_side == "left"


def test_bad_references_name_file_and_key(tmp_path):
    ref = tmp_path / "base.json"
    with pytest.raises(ArtifactError, match="base.json: model reference not found"):
        load_reference(ref)
    ref.write_text("{not json")
    with pytest.raises(ArtifactError, match="base.json: not valid JSON"):
        load_reference(ref)
    ref.write_text(json.dumps({"kind": "s3"}))
    with pytest.raises(ArtifactError, match="base.json: key 'kind'"):
        load_reference(ref)
    ref.write_text(json.dumps({"kind": "hub", "model_id": "Qwen/Qwen2.5-0.5B"}))
    with pytest.raises(ArtifactError, match="base.json: key 'revision'"):
        load_reference(ref)
    # a hub model is loaded from its fetched snapshot, never from the network
    ref.write_text(json.dumps({"kind": "hub", "model_id": "Qwen/Qwen2.5-0.5B", "revision": "main"}))
    with pytest.raises(ArtifactError, match="no locked commit: fetch it .*python -m stages.fetch"):
        load_reference(ref)
    ref.write_text(json.dumps({"kind": "hub", "model_id": "Qwen/Qwen2.5-0.5B", "revision": "main",
                               "commit": "c" * 40, "files": {"model.safetensors": 10}}))
    with pytest.raises(ArtifactError, match=r"model Qwen/Qwen2.5-0.5B@cccccccccccc: file "
                                            r"model.safetensors missing from the snapshot store"):
        load_reference(ref)


def test_a_corrupt_checkpoint_is_a_clear_error(saved, tmp_path):
    folder, _, _ = saved
    broken = tmp_path / "ckpt"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"garbage")
    (tmp_path / "base.json").write_text(json.dumps({"kind": "scratch", "path": "ckpt"}))
    with pytest.raises(ArtifactError, match="base.json: cannot load the model"):
        load_model_and_tokenizer(tmp_path / "base.json")


def test_find_gguf_without_importing_the_package(tmp_path, monkeypatch):
    from stages.core.models.modeling import GgufNotFound, find_gguf

    pkg = tmp_path / "standin_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('importing it is the bug')\n")
    (pkg / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    path, dist, version = find_gguf("standin_gguf_pkg", "m.gguf")
    assert path == pkg / "m.gguf" and dist == "standin_gguf_pkg" and version == "unknown"
    with pytest.raises(GgufNotFound, match="no file 'x.gguf' in package") as err:
        find_gguf("standin_gguf_pkg", "x.gguf")
    assert err.value.field == "file"
    with pytest.raises(GgufNotFound, match="no installed package 'no_such_pkg_ict'") as err:
        find_gguf("no_such_pkg_ict", "m.gguf")
    assert err.value.field == "package"


def test_sha256_file_by_hand(tmp_path):
    from stages.core.common.io import sha256_file

    (tmp_path / "f").write_bytes(b"abc")
    assert sha256_file(tmp_path / "f", block=2) == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")


def test_a_reference_may_say_where_its_folder_came_from(saved):
    folder, _, _ = saved
    ref = folder.parent / "gguf.json"
    ref.write_text(json.dumps({"kind": "scratch", "path": "checkpoint", "origin": "gguf"}))
    assert load_reference(ref)["path"] == str(folder.resolve())
