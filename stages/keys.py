"""What each stage's job reads of the config, and where training saves its checkpoints: the
workflow parses its rules with these (each rule hashes the keys its stage reads), so this module
imports nothing heavier than the config (no torch): a dry run and every SLURM job's own Snakemake
parse stay fast. The stage modules re-export them under their old names."""

from __future__ import annotations

from .config import Config, Train

EVALUATE_KEYS = ("backend", "n", "temperature", "top_p", "max_new_tokens", "k", "bootstrap",
                 "grade_timeout_s", "batch_size", "graders", "batch_invariant", "engine_kwargs")


def rollout_config_keys(cfg: Config, size: str) -> tuple[str, ...]:
    """The parts of the config this stage reads (its rule hashes the same ones)."""
    return ("rollout", f"models/{size}", "seed", "train/reward_correct", "train/reward_incorrect",
            "experiment/train_datasets",
            *(f"datasets/{d}/grader" for d in cfg.experiment.train_datasets))


def train_config_keys(cfg: Config, size: str, method: str) -> tuple[str, ...]:
    """The parts of the config this stage reads (rule train's config_hash lists the same): the
    token-statistics chunking, not the token-statistics stage's own keys."""
    return ("train", f"methods/{method}", f"models/{size}", "seed", "token_stats/chunk_positions",
            "token_stats/chunk_vocab", "evaluate/grade_timeout_s", "experiment/train_datasets",
            *(f"datasets/{d}/{key}" for d in cfg.experiment.train_datasets
              for key in ("max_response_tokens", "grader")))


def evaluate_config_keys(size: str, bench: str, method: str = "base") -> tuple[str, ...]:
    """The parts of the config one evaluation reads (its rule hashes the same ones). The method
    and its training reach an evaluation only through the model file and its evaluation changes
    (methods.<m>.evaluate), the benchmark's source and template only through the problems file:
    when those change, the files do."""
    own = () if method == "base" else (f"methods/{method}/evaluate",)
    return (*(f"evaluate/{k}" for k in EVALUATE_KEYS), f"datasets/{bench}/role",
            f"datasets/{bench}/grader", f"models/{size}/tensor_parallel_size",
            f"models/{size}/stop_tokens", "seed", *own)


def overlap_config_keys(size: str) -> tuple[str, ...]:
    """The parts of the config this stage reads (its rule hashes the same ones)."""
    return ("rollout/temperature", "token_stats", f"models/{size}/label", "seed")


def checkpoint_name(step: int) -> str:
    """The folder, inside the training's output folder, of the checkpoint saved after `step` steps."""
    return f"checkpoints/step={step}"


def checkpoint_steps(tcfg: Train) -> list[int]:
    """The steps after which a checkpoint is saved (train.save_every; the final model is not one)."""
    if not tcfg.save_every:
        return []
    return list(range(tcfg.save_every, tcfg.steps, tcfg.save_every))
