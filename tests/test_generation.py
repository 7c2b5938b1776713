"""The hf sampler's stopping rules: end-of-text and the chat template's end-of-turn token, or
verl's (end-of-text and the generation config's ids), and one generation limit per prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stages.core.models.generation import sample_hf, stop_token_ids
from stages.core.models.modeling import build_tokenizer


class ScriptedModel(torch.nn.Module):
    """A causal LM whose every forward makes the next token of a fixed continuation (ids) certain,
    whatever it is asked; it counts its forwards and the rows each one ran."""

    config = None

    def __init__(self, continuation, vocab: int = 512):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.continuation, self.vocab = continuation, vocab
        self.rows: list[int] = []  # rows of each forward
        self.cache = None

    def forward(self, input_ids, past_key_values=None, **kw):
        if past_key_values is not self.cache:  # a new batch: the continuation starts again
            self.cache, self.step = past_key_values, 0
        self.rows.append(input_ids.shape[0])
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e9)
        logits[..., self.continuation[self.step]] = 0.0
        self.step += 1
        return SimpleNamespace(logits=logits)


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
    # y's row leaves the batch at its own limit, x's at its end of turn: 3 forwards, not 6
    assert model.rows == [2, 2, 1]
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
    assert out[0].response_token_ids == [a, im_end, b, listed] and out[0].finish_reason == "stop"
    out = sample_hf(model, tok, ["x"], n=1, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=0,
                    batch_size=8)
    assert out[0].response_token_ids == [a, im_end]  # ours: cut at the end of the turn
    with pytest.raises(ValueError, match="unknown stop rule 'im_end'"):
        stop_token_ids(tok, "im_end")


class GenerateReference:
    """The decode loop's oracle: transformers' generate() with a logits processor that picks each
    row's token with the same seeded sampler (how sample_hf sampled until 2026-12-02)."""

    def __init__(self, sampler, start: int):
        self.sampler, self.start, self.logprobs = sampler, start, []

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.start
        chosen, lp = self.sampler(torch.arange(scores.shape[0]), step, scores)
        self.logprobs.append(lp)
        return torch.full_like(scores, -torch.inf).scatter_(1, chosen[:, None], 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.6, 0.9), (0.0, 1.0)])
def test_the_decode_loop_equals_transformers_generate(dtype, temperature, top_p):
    """Rows that stop early leave the batch; every row's tokens are generate()'s, and its
    log-probs too up to the rounding of the batch's kernels."""
    from transformers import LogitsProcessorList

    from stages.core.models.generation import SeededSampler, decode, greedy, left_padded
    from stages.core.models.modeling import build_scratch_model

    tok = build_tokenizer()
    eos = tok.eos_token_id
    arch = SimpleNamespace(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = build_scratch_model(arch, len(tok), eos, seed=3).eval()
    with torch.no_grad():  # end-of-text (the padding row: zeros) likely at some positions
        model.lm_head.weight[eos] = torch.randn(32, generator=torch.Generator().manual_seed(0))
    model = model.to(dtype)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("1+2=", "33*4=", "7", "9-8+1=")]
    ids, att = left_padded(prompts, eos)
    width = ids.shape[1]
    limits = [12, 5, 12, 9]

    def picker():
        return SeededSampler([11, 12, 13, 14], 12, temperature, top_p) if temperature else greedy

    tokens, logprobs, lengths = decode(model, ids, att, limits, [eos], eos, picker())
    ref_pick = picker()
    ref = GenerateReference(ref_pick, width) if temperature else None
    want = model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=12,
                          logits_processor=LogitsProcessorList([ref] if ref else []),
                          eos_token_id=[eos], pad_token_id=eos)[:, width:]
    stopped = 0
    for r, limit in enumerate(limits):
        row = want[r, :limit].tolist()
        end = row.index(eos) + 1 if eos in row else limit
        stopped += end < limit
        assert tokens[r, : lengths[r]].tolist() == row[:end], r
        if temperature:
            lp = torch.stack(ref.logprobs, dim=1)[r, :end]
            # a smaller batch's kernels may round differently: the last bits of the logits
            torch.testing.assert_close(logprobs[r, : lengths[r]], lp, rtol=0,
                                       atol=1e-5 if dtype == torch.float32 else 2e-2)
        else:
            assert logprobs is None
    assert stopped >= 1  # some row left the batch before the others
