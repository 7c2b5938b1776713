"""Where each stage's outputs of one run live: `results/<run>/...`, hive-style, so that each
folder reads as one table (`pl.scan_parquet(..., hive_partitioning=True)`).

The workflow's rules (workflow/rules/common.smk) and the guard of finished trainings
(stages.reruns) build every path here, so that the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunPaths:
    """The paths of one run; `results` is `results/<run>` (relative to the working folder)."""

    results: str

    def data(self, dataset: str) -> str:
        return f"{self.results}/data/dataset={dataset}/problems.parquet"

    def model_dir(self, size: str) -> str:
        return f"{self.results}/models/size={size}"

    def base_ref(self, size: str) -> str:
        return f"{self.model_dir(size)}/base.json"

    def rollouts(self, size: str) -> str:
        return f"{self.results}/rollouts/size={size}/rollouts.parquet"

    def token_stats_dir(self, size: str) -> str:
        return f"{self.results}/token_stats/size={size}"

    def train_dir(self, size: str, method: str, seed) -> str:
        """Training of one size x method x seed: model.json (reference to final/), final/,
        metrics.parquet."""
        return f"{self.results}/train/size={size}/method={method}/seed={seed}"

    def resume_dir(self, size: str, method: str, seed) -> str:
        """A training's resume states: not an output, so Snakemake never deletes them."""
        return f"{self.results}/resume/size={size}/method={method}/seed={seed}"

    def eval_dir(self, size: str, method: str, seed, bench: str) -> str:
        """Evaluation of one model on one benchmark; method "base" is the untrained base model."""
        return f"{self.results}/eval/size={size}/method={method}/seed={seed}/bench={bench}"

    def eval_steps_dir(self, size: str, method: str, seed, step, bench: str) -> str:
        """Evaluation of the checkpoint saved after `step` rollout steps (train.save_every)."""
        return (f"{self.results}/eval_steps/size={size}/method={method}/seed={seed}/step={step}"
                f"/bench={bench}")

    def overlap(self, size: str, method: str, seed) -> str:
        """The 80/20 paper's overlap of the top-entropy positions, base vs one trained model."""
        return f"{self.results}/overlap/size={size}/method={method}/seed={seed}/overlap.parquet"

    def train_log(self, size: str, method: str, seed) -> str:
        return f"{self.results}/logs/train/{size}/{method}/{seed}.log"

    def log(self, rule: str, *wildcards) -> str:
        """A job's log: logs/<rule>/<its wildcards, in the rule's order>.log."""
        return f"{self.results}/logs/{rule}/{'/'.join(map(str, wildcards))}.log"

    def of_training(self, size: str, method: str, seed) -> list[str]:
        """The folders and files one training and everything made from it fill: the training,
        its evaluations (final and over steps), its overlap and its log."""
        model = f"size={size}/method={method}/seed={seed}"
        return [self.train_dir(size, method, seed), f"{self.results}/eval/{model}",
                f"{self.results}/eval_steps/{model}", f"{self.results}/overlap/{model}",
                self.train_log(size, method, seed)]

    def resolved_config(self) -> str:
        return f"{self.results}/resolved_config.yaml"

    def replaced(self) -> str:
        """Where finished trainings that a rerun replaced are kept (stages.reruns)."""
        return f"{self.results}/replaced"
