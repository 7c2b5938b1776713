"""How a training job's ranks form groups: sequence-parallel groups of consecutive ranks, and the
data-parallel groups across them. Plain arithmetic without torch, so that the config's checks
(stages.config), the engine glue and verl's virtual layout (stages.core.statistics.batching) hold
the job to one rule."""

from __future__ import annotations

from stages.core.common.errors import ConfigError


def sequence_parallel_misfit(sequence_parallel: int, world: int, ranks: str) -> str | None:
    """Why `world` ranks do not form whole groups of `sequence_parallel` ("k does not divide
    <ranks>": `ranks` names the world as the caller's message says it), or None when they do."""
    if world % sequence_parallel:
        return f"{sequence_parallel} does not divide {ranks}"
    return None


def parallel_groups(world: int, sequence_parallel: int) -> tuple[list[list[int]], list[list[int]]]:
    """(sequence-parallel groups, data-parallel groups) of the job's ranks: sequence-parallel
    groups are blocks of consecutive ranks (as DeepSpeed's parallel_state_sp makes them, and
    as the ranks of one node come), a data-parallel group takes the same place in every block."""
    if why := sequence_parallel_misfit(sequence_parallel, world, f"the job's {world} processes"):
        raise ConfigError(f"train.sequence_parallel: {why}")
    sp = [list(range(g, g + sequence_parallel)) for g in range(0, world, sequence_parallel)]
    dp = [list(range(j, world, sequence_parallel)) for j in range(sequence_parallel)]
    return sp, dp
