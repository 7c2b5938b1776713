"""One typed, validated model of the whole workflow configuration.

The Snakefile and every stage load the config through :func:`load_config`, so a bad key is
reported the same way everywhere: the file, the dotted key and what is wrong with it.
Every field has its default and its one-line documentation here, and nowhere else.

One module per section of the config, the top level and the checks across sections apart:

- base: the Strict base model, Name, the engine_kwargs field, the errors at a key, digest
- experiment, datasets, models, methods, rollout, token_stats, train (its loss: loss),
  evaluate, resources, cost, numerics, hub: one section each
- checks: the validators that look across sections, and every lookup into stages.core's
  registries (vLLM's engine arguments, selectors, graders, reported rows, hub models)
- schema: Config, the whole file, with the helpers the Snakefile and the stages share
- load: reading the YAML, importing selector_modules, validating into one ConfigError

Everything public is importable from here (`from stages.config import Config`). The package sits
above stages.core: the library imports it only under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

from .base import ConfigError, Name, Strict, digest, engine_kwargs_field
from .checks import ENGINE_SET_BY_US, TRAIN_ENGINE_SET_BY_US, check_engine_kwargs
from .cost import Cost, CostRates, RuleRates
from .datasets import Dataset, GeneratedSource, HubSource, LocalSource, Source
from .evaluate import Evaluate
from .experiment import Experiment
from .hub import Hub
from .load import import_selector_modules, load_config, load_configs, load_yaml, source_of, validate
from .loss import Loss
from .methods import Method, MethodEvaluate
from .models import GgufModel, Gpus, HubModel, ModelSize, ScratchArch, Sft
from .numerics import Numerics
from .resources import ResourceOverride, Resources, RuleResources, SizedRuleResources
from .rollout import Rollout
from .schema import Config
from .token_stats import TokenStats
from .train import Train, VirtualLayout

__all__ = [
    "ENGINE_SET_BY_US", "TRAIN_ENGINE_SET_BY_US", "Config", "ConfigError", "Cost", "CostRates", "RuleRates",
    "Dataset", "Evaluate", "Experiment", "GeneratedSource", "GgufModel", "Gpus", "Hub", "HubModel",
    "HubSource", "LocalSource", "Loss", "Method", "MethodEvaluate", "ModelSize", "Name", "Numerics",
    "ResourceOverride", "Resources", "Rollout", "RuleResources", "ScratchArch", "Sft",
    "SizedRuleResources", "Source", "Strict", "TokenStats", "Train", "VirtualLayout",
    "check_engine_kwargs", "digest", "engine_kwargs_field", "import_selector_modules",
    "load_config", "load_configs", "load_yaml", "source_of", "validate",
]
