"""The hf sampler's stopping rules: end-of-text and the chat template's end-of-turn token, or
verl's (end-of-text and the generation config's ids), and one generation limit per prompt."""

from __future__ import annotations

import pytest
import torch

from stages.core.models.generation import sample_hf, stop_token_ids
from stages.core.models.modeling import build_tokenizer


class ScriptedModel(torch.nn.Module):
    """generate() returns the prompt followed by a fixed continuation (ids), whatever it is asked."""

    def __init__(self, continuation):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.continuation = continuation
        self.kwargs = []

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kw):
        self.kwargs.append({"max_new_tokens": max_new_tokens, "eos_token_id": eos_token_id})
        tail = torch.tensor(self.continuation[:max_new_tokens]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, tail], dim=1)


def test_stop_ids_follow_the_chat_template():
    tok = build_tokenizer()
    eos, im_end = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tok) == [eos]  # no chat template: end-of-text only
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert stop_token_ids(tok) == [eos, im_end]


def test_responses_stop_at_end_of_turn_and_at_their_own_limit():
    tok = build_tokenizer()
    tok.chat_template = "<|im_start|>{{ messages[0]['content'] }}<|im_end|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    a, b = tok("ab", add_special_tokens=False)["input_ids"]
    model = ScriptedModel([a, b, im_end, a, a, a])
    out = sample_hf(model, tok, ["x", "y"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=[6, 2],
                    seed=0, batch_size=8)
    assert model.kwargs == [{"max_new_tokens": 6, "eos_token_id": [tok.eos_token_id, im_end]}]
    assert out[0].response_token_ids == [a, b, im_end] and out[0].finish_reason == "stop"
    assert out[0].response == "ab"  # the end-of-turn token is special: not in the text
    assert out[1].response_token_ids == [a, b] and out[1].finish_reason == "length"


def test_verls_stop_rule_reads_the_generation_config_of_a_model_folder(tmp_path):
    """A model folder whose generation_config.json lists one end-of-text id, and a ChatML chat
    template: our rule stops at <|im_end|> as well, verl's (vLLM with no stop list) at the
    tokenizer's eos and the generation config's id only, so a base model writes on past
    <|im_end|>, as upstream's responses do."""
    import json

    from transformers import AutoTokenizer, GenerationConfig

    tok = build_tokenizer()
    tok.chat_template = "<|im_start|>{{ messages[0]['content'] }}<|im_end|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    listed = tok("z", add_special_tokens=False)["input_ids"][0]  # an id no other rule stops at
    tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": listed}))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    config = GenerationConfig.from_pretrained(tmp_path)
    eos = tok.eos_token_id
    assert stop_token_ids(tok) == [eos, im_end]
    assert stop_token_ids(tok, "generation_config", config) == [eos, listed]
    assert stop_token_ids(tok, "generation_config", {"eos_token_id": [listed, eos]}) == [eos, listed]
    assert stop_token_ids(tok, "generation_config") == [eos]  # vLLM adds its model's ids itself
    a, b = tok("ab", add_special_tokens=False)["input_ids"]
    model = ScriptedModel([a, im_end, b, listed, a])
    model.generation_config = config
    out = sample_hf(model, tok, ["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=0,
                    batch_size=8, stop_tokens="generation_config")
    assert model.kwargs[0]["eos_token_id"] == [eos, listed]
    assert out[0].response_token_ids == [a, im_end, b, listed] and out[0].finish_reason == "stop"
    out = sample_hf(model, tok, ["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=0,
                    batch_size=8)
    assert out[0].response_token_ids == [a, im_end]  # ours: cut at the end of the turn
    with pytest.raises(ValueError, match="unknown stop rule 'im_end'"):
        stop_token_ids(tok, "im_end")
