"""The numbers the papers report, printed beside ours and never mixed into our cells (METHODS §7, §9).

ICT: every number is as one or more summaries of the paper's full text give it (the PDF is not in
our stores and no code is public); tables label them "reported (summaries of ICT Table 1)" or
similar. The 80/20 paper (20-Entropy on Qwen3 with DAPO): its Figure 1 and summaries of its text;
tables label them "reported (80/20 paper, Figure 1 and summaries)". Percentages, as printed.
"""

from __future__ import annotations

from dataclasses import dataclass

ICT_SOURCE = ("Feng et al., arXiv 2606.19771, as summaries of its full text report them "
              "(shared METHODS §7)")

ROWS_8020 = ("80/20: DAPO", "80/20: top-20% entropy", "80/20: top-20% entropy, 29k")
"""The 80/20 paper's runs (Qwen3 base models, DAPO on DAPO-Math-17k): all tokens, the top 20% by
entropy, and the 32B top-20% run at a 29k response length. Apart from ICT's rows: its
"20-Entropy" row is ICT's run of that rule on Qwen2.5, not the 80/20 paper's."""

REPORTED_ROWS = ("Base", "GRPO", "20-Entropy", "STAPO", "ICT",
                 "10%-unique", "20%-unique", "30%-unique", "90%-frequent", "random 10%", *ROWS_8020)
"""Row names a method may claim with `methods.<name>.paper_row`: the methods of ICT's Table 1, the
rows of its ratio ablation (Qwen2.5-1.5B on GSM8K), and the 80/20 paper's runs (ROWS_8020)."""


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


# ---------------------------------------------------------------------------------------------
# The 80/20 paper (METHODS §9): Qwen3-8B/14B/32B-Base, DAPO on DAPO-Math-17k, Acc@16
# ---------------------------------------------------------------------------------------------
PAPER_8020_SOURCE = ("Wang et al., 'Beyond the 80/20 Rule' (arXiv 2506.01939), its Figure 1 and "
                     "summaries of its text (shared METHODS §9)")
PAPER_8020_SIZES = ("8B", "14B", "32B")  # Qwen3-<size>-Base
PAPER_8020_BENCHMARKS = ("AIME'24", "AIME'25", "AMC'23", "MATH-500", "Minerva", "OlympiadBench")


@dataclass(frozen=True)
class Acc16:
    """Acc@16 in % (avg@16: the mean accuracy over 16 samples per problem, not pass@16) of one
    run; mean6: the mean over PAPER_8020_BENCHMARKS. None: not known."""

    aime24: float | None
    aime25: float | None
    mean6: float | None
    amc23: float | None = None


# Keyed by (Qwen3 size, row of ROWS_8020). Figure 1 and summaries: all tokens (DAPO) -> top 20%.
TABLE_8020: dict[tuple[str, str], Acc16] = {
    ("8B", "80/20: DAPO"): Acc16(33.3, 25.4, 53.71, amc23=77.81),
    ("8B", "80/20: top-20% entropy"): Acc16(34.6, 26.2, 54.23, amc23=77.19),
    ("14B", "80/20: DAPO"): Acc16(45.2, 38.1, 61.40),
    ("14B", "80/20: top-20% entropy"): Acc16(50.4, 42.9, 64.39),
    ("32B", "80/20: DAPO"): Acc16(55.83, 45.63, 66.59),
    ("32B", "80/20: top-20% entropy"): Acc16(63.54, 56.67, 70.69),
    ("32B", "80/20: top-20% entropy, 29k"): Acc16(68.1, None, None),  # its other settings unknown
}

# Token statistics of the 80/20 paper (Qwen3-8B, thinking mode, AIME, T = 1.0, over 10^6 tokens).
ENTROPY_BELOW_001_PCT_8020 = 50.64  # % of tokens with H < 0.01
OVERLAP_MIN_PCT_8020 = 86.67  # Table 1: top-20% entropy positions, base vs RLVR checkpoints, ≥ this
OVERLAP_TOP_8020 = 0.2


def jaccard_of_overlap(overlap: float) -> float:
    """The Jaccard index |A ∩ B| / |A ∪ B| of two equally large sets whose overlap |A ∩ B| / |A|
    is `overlap` (a fraction): o / (2 − o). The paper's 86.67% overlap is a Jaccard of 0.765."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"an overlap is a fraction in [0, 1], got {overlap}")
    return overlap / (2.0 - overlap)
