"""Per-token statistics of a policy's distributions: entropy, Renyi-2, log p and ICT's Jensen-Shannon
uniqueness, computed in chunks over the vocabulary, and the scoring passes and micro-batch plans
that feed them.

May import stages.core.common, data, reward and models. (tests/test_layers.py checks the order.)
"""
