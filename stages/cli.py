"""What every stage's command line shares: the arguments, logging and clean error exits."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from .config import Config, ConfigError, load_config
from .core.common import environment, hub, io, numerics, timing
from .core.common.io import ArtifactError

log = logging.getLogger("stages")

# Errors a user can act on: printed as one clear line naming the file and key, exit code 2.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, ArtifactError, FileNotFoundError)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", required=True, help="workflow config YAML (validated)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all)")
    return p


def run(main: Callable[[argparse.Namespace, Config], None], p: argparse.ArgumentParser) -> None:
    """Parse arguments, load the config, run `main`, and turn user errors into one-line exits."""
    args = p.parse_args()
    logging.basicConfig(
        level=os.environ.get("ICT_RLVR_LOGLEVEL", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        cfg = load_config(args.config)
        numerics.apply(cfg.numerics.cpu_isa)  # by hand: starts again with the settings
        # offline, with the run's caches, whoever started the job (stages.core.common.hub): set
        # before transformers, datasets or vLLM is imported, which read them once
        os.environ.update(hub.job_environment(cfg))
        io.HUB_SOURCES.update(hub.sources(cfg))  # every output's provenance names the commits
        environment.check()  # a warning where the installed packages are not the lock's
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        try:
            main(args, cfg)
        except SystemExit as stop:  # a training stopped to be resubmitted (status 75)
            log_timing(stop.code if isinstance(stop.code, int) else 1)
            raise
        log_timing(0)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except ValueError as err:
        # adapter and validation errors subclass ValueError and carry file and key
        if type(err).__module__.startswith("stages"):
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        raise


def log_timing(status: int) -> None:
    """The job's timing line (stages.core.common.timing), from one process of a job (rank 0)."""
    if os.environ.get("RANK", "0") == "0":
        main = sys.modules["__main__"]
        name = getattr(main, "__spec__", None) and main.__spec__.name or "stages"
        stage = name.removesuffix(".__main__").rpartition(".")[2]
        log.info("%s", timing.line(stage, status))
