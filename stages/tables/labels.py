"""Printed names of methods, sizes and benchmarks; the method groups; what the config's grid asks for."""

from __future__ import annotations

import re

from ..config import Config
from ..core.common.names import ICT_LABELS
from ..core.report.render import MISSING

HEADLINE_K = 4  # ICT reports pass@4
TOTAL_KS = (1, 4)  # ICT's Total is the mean of P@1 and P@4
NOT_ICT = "not ICT"
READINGS = {variant: label.removesuffix(" (ours, not ICT)")
            for variant, label in ICT_LABELS.items() if variant != "paper"}
"""ICT variants that are our readings, never ICT (METHODS §3): the earlier token_id and
scope_position, contradicted by the recovered text, and the readings of the reference that the
summaries leave open (the response's own average, the group's pooled average, the group-step mean
leaving the response out). Labelled as ours and never as ICT."""


def _non_default(selector: str, params: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """`params` that differ from the selector's defaults, printed (ρ=0.2, part=frequent)."""
    from ..core.training.selectors import spec_of

    default = spec_of(selector).validate({}).model_dump()
    return [_param_text(k, v) for k, v in params.items()
            if k not in skip and k != "seed" and v != default.get(k)]


def _param_text(key: str, value) -> str:
    name = {"rho": "ρ", "tau_p": "τ_p"}.get(key, key)
    return f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"


def is_reading(cfg: Config, name: str) -> bool:
    """An `ict`-selector method with one of our readings (READINGS), not the paper's rule."""
    m = cfg.methods.get(name)
    return m is not None and m.selector == "ict" and m.selector_params()["variant"] in READINGS


def is_ict(cfg: Config, name: str) -> bool:
    """ICT's rule as the paper defines it: variant paper, the top ρ (not the 'frequent' complement)."""
    m = cfg.methods.get(name)
    if m is None or m.selector != "ict":
        return False
    p = m.selector_params()
    return p["variant"] == "paper" and p["part"] == "unique"


def method_label(cfg: Config, name: str) -> str:
    """The printed name. ICT's rule without a label is 'ICT' (with its parameters where they
    differ from the defaults); our earlier readings never read as ICT: without a label they are
    'JSD token-id reading (ours, not ICT)' and so on, and a label that does not say 'not ICT'
    is put after the reading's name."""
    if name == "base":
        return "Base model"
    m = cfg.methods[name]
    if m.selector != "ict":
        return m.label or name
    params = m.selector_params()
    variant = params["variant"]
    if variant == "paper":
        if m.label:
            return m.label
        if params["part"] == "frequent":  # the paper's "90%-frequent" control
            extra = _non_default("ict", params, skip=("rho", "part"))
            return (f"{round(100 * (1 - params['rho']), 6):g}%-frequent (complement of ICT)"
                    + (f" ({', '.join(extra)})" if extra else ""))
        extra = _non_default("ict", params)
        return "ICT" + (f" ({', '.join(extra)})" if extra else "")
    if m.label:
        return m.label if NOT_ICT.lower() in m.label.lower() else (
            f"{READINGS[variant]} (ours, {NOT_ICT}): {m.label}")
    extra = _non_default("ict", params, skip=("variant",))
    return f"{READINGS[variant]}{''.join(' ' + e for e in extra)} (ours, {NOT_ICT})"


def method_params(cfg: Config, name: str) -> str:
    """The selector and its parameters (all of them, defaults included), and the warm-up Θ."""
    m = cfg.methods[name]
    parts = [m.selector]
    for key, value in m.selector_params().items():
        if key == "seed" or (key, value) in (("variant", "paper"), ("part", "unique")):
            continue  # the trainer's generator replaces the seed; paper/unique: ICT's rule
        if key == "variant":
            parts.append(f"{value} reading (ours, {NOT_ICT})")
        else:
            parts.append(_param_text(key, value))
    parts += [f"Θ={m.warmup_steps}"] if m.warmup_steps else []
    return ", ".join(parts)


def size_label(cfg: Config, size: str) -> str:
    return cfg.models[size].label or size


def bench_label(cfg: Config, bench: str) -> str:
    return cfg.datasets[bench].label or bench


def reported_text(v: float | None) -> str:
    """A paper's number as printed there: two decimals."""
    return MISSING if v is None else f"{v:.2f}"


def method_groups(cfg: Config) -> tuple[list[str], list[str]]:
    """(methods of the main table, methods only in the ablation table), in experiment order."""
    main = cfg.evaluate.main_methods
    if main is None:
        return list(cfg.experiment.methods), []
    main = [m for m in cfg.experiment.methods if m in main]
    return main, [m for m in cfg.experiment.methods if m not in main]


def grpo_method(cfg: Config, methods: list[str]) -> str | None:
    """The full-token baseline that Δ columns compare with: the first method training on all tokens."""
    return next((m for m in methods if cfg.methods[m].selector == "all"), None)


def headline(cfg: Config) -> str:
    """The main tables' metric (evaluate.headline): pass@k with k in evaluate.k, or avg@n."""
    return cfg.evaluate.headline


def metric_key(metric: str) -> str:
    """pass@4 -> pass4, avg@16 -> avg16: the metric in file stems and CSV column names."""
    return metric.replace("@", "")


def delta_label(metric: str) -> str:
    """The Δ column of a metric: Δ@4 for pass@4 (as ICT prints it), Δ avg@16 for avg@16."""
    return f"Δ@{metric.split('@')[1]}" if metric.startswith("pass@") else f"Δ {metric}"


def delta_key(metric: str) -> str:
    """delta4 for pass@4, delta_avg16 for avg@16 (CSV column names)."""
    return f"delta{metric.split('@')[1]}" if metric.startswith("pass@") else f"delta_{metric_key(metric)}"


def metric_note(cfg: Config, metric: str) -> str:
    """What a metric is, for the notes: the estimator and the evaluation's sampling."""
    ev = cfg.evaluate
    sampling = (f"(T = {ev.temperature:g}, top-p = {ev.top_p:g}, at most {ev.max_new_tokens} new "
                "tokens)")
    if metric.startswith("avg@"):
        return (f"{metric} in % (the 80/20 paper's Acc@{ev.n}): the mean accuracy over the n = {ev.n} "
                f"samples of each problem, not pass@{ev.n} {sampling}")
    return f"{metric} in %: unbiased estimator from n = {ev.n} samples per problem {sampling}"


def hub_size(cfg: Config, size: str, pattern: re.Pattern, family: str | None = None) -> str | None:
    """The paper size a hub model stands for: the one size `pattern` (group 1) finds in its model
    id, else in its size key (lower case), in a name that contains `family` (when given); None for
    scratch models and for names with none (or with two different ones)."""
    model = cfg.models[size]
    if model.source != "hub":
        return None
    for name in (model.hub.model_id.lower(), size.lower()):
        if family is not None and family not in name:
            continue
        found = {m.group(1) for m in pattern.finditer(name)}
        if len(found) == 1:
            return f"{found.pop()}B"
        if found:
            return None
    return None


def reference_row(cfg: Config, methods: list[str]) -> list[str]:
    """`methods` with the full-token baseline (grpo_method) first, the others in their order."""
    ref = grpo_method(cfg, methods)
    return ([ref] if ref else []) + [m for m in methods if m != ref]


def curve_methods(cfg: Config) -> list[str]:
    """Experiment methods whose training saves checkpoints (train_for(m).save_every)."""
    return [m for m in cfg.experiment.methods
            if any(cfg.train_for(m, s).save_every for s in cfg.experiment.sizes)]


def curve_benchmarks(cfg: Config) -> list[str]:
    """The benchmarks of the curves over steps (evaluate.curve_benchmarks, else all)."""
    return list(cfg.evaluate.curve_benchmarks or cfg.experiment.benchmarks)


def has_total(cfg: Config) -> bool:
    """Whether the run evaluates both k of ICT's Total (and so has the main_total table)."""
    return set(TOTAL_KS) <= set(cfg.evaluate.k)


def line_styles(cfg: Config, methods: list[str]) -> dict[str, dict]:
    """Line style per method in the figures: the base model dotted black, ablations dashed."""
    main, _ = method_groups(cfg)
    styles, colour = {}, 0
    for m in methods:
        if m == "base":
            styles[m] = {"color": "black", "linestyle": ":"}
        else:
            styles[m] = {"color": f"C{colour % 10}", "linestyle": "-" if m in main else "--"}
            colour += 1
    return styles
