"""Exact per-token statistics of the full-vocabulary distribution (METHODS §2).

For a position with logits z ∈ R^V and temperature T the distribution is p = softmax(z / T).
Every quantity is in nats:

- ``entropy``   H(p)  = -Σ_j p_j log p_j
- ``renyi2``    H2(p) = -log Σ_j p_j²            (0 ≤ H2 ≤ H ≤ log V)
- ``logsumexp`` log Σ_j exp(z_j / T)
- ``max_prob``  max_j p_j                        (a probability, not a log)
- ``logprob``   log p(o) of the sampled token o
- ``jsd``       d = JSD(p ‖ p̄), p̄ the mean distribution over the valid positions of the scope
- :func:`group_step_jsd`  ICT's uniqueness u_{i,t} = JSD(p_{i,t} ‖ P̄_t), P̄_t the mean over the
  responses of i's group that are active at step t (METHODS §3); with other keys, or leaving
  the row out of its own reference, the readings of the reference that the summaries leave open
- :func:`group_step_reference`  the same u and, in the same pass, the reference's probability of
  the position's token P̄(y) (ICT: P̄_t(y_{i,t})) and its β = Σ_a P̄(a)², float64 (REFERENCE_FIELDS);
  :func:`mean_without` leaves a part of a reference (the row, the response) out of its mean
- :func:`jsd_ceiling`  c(w), the largest JSD(p ‖ w·p + (1 − w)·r): how far u can go when p's own
  weight in its reference is w
- :func:`diverged_positions`  the positions whose response prefix no other active response of the
  group shares

Where the code lives (this module imports its functions, and the constants LN2 and
REFERENCE_FIELDS, from there; the settings that those modules read, such as the chunk sizes and
tolerances, only their own module holds, so that a patch or a read reaches the value in use):

- stages.core.statistics.blocks  the one implementation: block math, logit sources,
  chunking (the settings CHUNK_POSITIONS, CHUNK_VOCAB, CACHE_BLOCKS, PIECE_BYTES), LN2,
  jensen_shannon;
- stages.core.statistics.per_token  token_statistics, chunked_token_statistics,
  distribution_sum, mean_distribution, jsd_to_mean;
- stages.core.statistics.uniqueness  group_step_jsd, group_step_reference, REFERENCE_FIELDS,
  mean_without (the setting U_FLOOR_ULPS);
- stages.core.statistics.ceiling  jsd_ceiling, at_ceiling, diverged_positions (the setting
  CEILING_RTOL).
"""

from stages.core.statistics.blocks import LN2, jensen_shannon
from stages.core.statistics.ceiling import at_ceiling, diverged_positions, jsd_ceiling
from stages.core.statistics.per_token import (
    chunked_token_statistics,
    distribution_sum,
    jsd_to_mean,
    mean_distribution,
    token_statistics,
)
from stages.core.statistics.uniqueness import (
    REFERENCE_FIELDS,
    group_step_jsd,
    group_step_reference,
    mean_without,
)

__all__ = [
    "LN2", "REFERENCE_FIELDS", "at_ceiling", "chunked_token_statistics", "diverged_positions",
    "distribution_sum", "group_step_jsd", "group_step_reference", "jensen_shannon", "jsd_ceiling",
    "jsd_to_mean", "mean_distribution", "mean_without", "token_statistics",
]
