"""Per-token statistics of a policy's distributions: entropy, Renyi-2, log p and ICT's Jensen-Shannon
uniqueness, computed in chunks over the vocabulary, and the scoring passes and micro-batch plans
that feed them.

stats is the public face of blocks (the one implementation: block math, logit sources),
per_token, uniqueness (ICT's u and its reference) and ceiling; deviations holds the readings of
u's reference, which scorer (the trainer's one scorer) and scoring (teacher forcing) share.

May import stages.core.common, data, reward and models. (tests/test_layers.py checks the order.)
"""
