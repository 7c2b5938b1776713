"""The policy: loading models and tokenizers, its layout over processes (DeepSpeed, Ulysses), its
engine, and the samplers that generate from it (hf, vLLM).

May import stages.core.common, data and reward. (tests/test_layers.py checks the order.)
"""
