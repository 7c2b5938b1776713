"""The hf sampler's stopping rules: end-of-text and the chat template's end-of-turn token, and
one generation limit per prompt."""

from __future__ import annotations

import torch

from stages.core.generation import sample_hf, stop_token_ids
from stages.core.modeling import build_tokenizer


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
