"""The numbers the papers report, printed beside ours and never mixed into our cells (METHODS §7).

Every number here is as one or more summaries of the ICT paper's full text give it (the PDF is
not in our stores and no code is public); tables label them "reported (summaries of ICT Table 1)"
or similar. Percentages, as printed in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

ICT_SOURCE = ("Feng et al., arXiv 2606.19771, as summaries of its full text report them "
              "(shared METHODS §7)")

REPORTED_ROWS = ("Base", "GRPO", "20-Entropy", "STAPO", "ICT",
                 "10%-unique", "20%-unique", "30%-unique", "90%-frequent", "random 10%")
"""Row names a method may claim with `methods.<name>.paper_row`: the methods of ICT's Table 1 and
the rows of its ratio ablation (Qwen2.5-1.5B on GSM8K)."""


@dataclass(frozen=True)
class Reported:
    """One reported cell group: pass@1, pass@4 and Total (printed as their mean), in %;
    None: not reported."""

    p1: float | None
    p4: float | None
    total: float | None = None


# ICT Table 1: averages over MATH-500, GSM8K, MMLU-STEM, GPQA and AIME 2023/2024/2025, mean of
# 5 seeds; one summary gives P@1 / P@4 / Total. Keyed by (paper model size, row).
TABLE1: dict[tuple[str, str], Reported] = {
    ("0.5B", "Base"): Reported(5.65, 14.48, 10.07),
    ("0.5B", "GRPO"): Reported(10.52, 18.97, 14.75),
    ("0.5B", "20-Entropy"): Reported(8.26, 16.37, 12.32),
    ("0.5B", "STAPO"): Reported(9.54, 18.29, 13.92),
    ("0.5B", "ICT"): Reported(10.95, 21.75, 16.35),
    ("1.5B", "Base"): Reported(16.41, 31.80, 24.11),
    ("1.5B", "GRPO"): Reported(18.22, 31.87, 25.05),
    ("1.5B", "20-Entropy"): Reported(18.66, 31.02, 24.84),
    ("1.5B", "STAPO"): Reported(19.89, 31.52, 25.71),
    ("1.5B", "ICT"): Reported(21.93, 36.53, 29.23),
    ("7B", "Base"): Reported(37.78, 55.25, 46.52),
    ("7B", "GRPO"): Reported(40.27, 54.16, 46.28),
    ("7B", "20-Entropy"): Reported(41.94, 53.29, 45.41),
    ("7B", "STAPO"): Reported(41.55, 55.52, 48.54),
    ("7B", "ICT"): Reported(42.99, 58.37, 50.68),
}
"""Totals as the summary prints them. They equal (P@1 + P@4) / 2 to rounding except 7B GRPO
(printed 46.28, mean 47.22) and 7B 20-Entropy (printed 45.41, mean 47.62): kept as printed."""

# Ratio ablation: Qwen2.5-1.5B trained and tested on GSM8K, P@1 / P@4 (two summaries agree).
RATIO_ABLATION: dict[str, Reported] = {
    "Base": Reported(43.10, 77.29),
    "GRPO": Reported(57.45, 78.45),
    "10%-unique": Reported(66.23, 85.31),
    "20%-unique": Reported(63.37, 83.31),
    "30%-unique": Reported(64.45, 83.76),
    "90%-frequent": Reported(60.62, 85.08),
    "random 10%": Reported(63.65, None),
}

# The abstract's headline: ICT's average and maximum pass@4 gain over GRPO, 20-Entropy and STAPO.
HEADLINE_AVG_GAIN_P4 = 4.58
HEADLINE_MAX_GAIN_P4 = 14.9
PER_SIZE_AVG_GAIN_P4 = {"0.5B": 4.37, "1.5B": 4.98, "7B": 4.38}

# Token statistics the papers report (for the token-statistics tables).
ENTROPY_BELOW_001_SHARE = 0.5  # 20-Entropy, Qwen3-8B CoTs: "over 50%" of tokens have H < 0.01
ENTROPY_P80 = 0.672  # 20-Entropy, Qwen3-8B: only 20% of tokens exceed H = 0.672 nats
ICT_HIGH_LOW_RATIO = {"GSM8K": 1.03, "MATH": 0.99}  # selected high- / low-entropy tokens
ICT_SELECTED_PROB = (0.18, 0.09)  # mean ± sd probability of ICT's selected tokens
