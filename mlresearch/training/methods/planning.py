"""One runner for every plan (:func:`execute`), and what is read off a plan before it runs: its
checks, its planned FLOPs (``mlresearch run --plan``) and its cost in GPU-hours (``mlresearch plan``).
Every phase's ledger entry equals its planned FLOPs (a test checks it), so no method counts its own."""

from __future__ import annotations

import torch

from ...families import FAMILIES
from ...tasks import task_of
from ..config import ConfigError, RunConfig
from ..flops import eval_flops_per_example, train_flops_per_example
from ..models import model_options, model_sizes
from ..phase import Phase
from .base import CHECKS, COSTS, METHODS, TRANSITIONS, Plan, State, Step


def build_plan(cfg: RunConfig, name: str) -> Plan:
    """The plan of method ``name`` for ``cfg``; unknown methods and transitions are config errors."""
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    plan = METHODS[name].plan(cfg)
    unknown = sorted({item.op for item in plan if isinstance(item, Step) and item.op not in TRANSITIONS})
    if unknown:
        raise ConfigError(f"method {name!r} plans unknown transition(s) {unknown}; known: {sorted(TRANSITIONS)}")
    return plan


def check_plan(cfg: RunConfig, plan: Plan, data) -> None:
    """Every transition of ``plan`` that needs something of the loaded data finds it."""
    for item in plan:
        if isinstance(item, Step) and item.op in CHECKS:
            CHECKS[item.op](cfg, item, data)


def execute(run, plan: Plan) -> torch.nn.Module:
    """Run ``plan`` over one state: phases through ``run.train``, transitions through the registry."""
    state = State()
    for item in plan:
        if isinstance(item, Phase):
            item = item.placed(state.position)
            if item.teacher is not None and state.teacher is None:
                raise ConfigError(f"phase {item.name!r} distils from a teacher, but the plan kept none before it")
            state.model, state.optimizer = run.train(state.model, state.optimizer, item,
                                                     teacher=state.teacher if item.teacher is not None else None)
            state.position = item.start + run.phases[-1]["steps"]
        else:
            TRANSITIONS[item.op](run, state, item)
    return state.model


def describe_run(name: str, config: dict) -> dict:
    """The table columns levels, scheme, alpha, optimizer, budget of a run of method ``name`` with
    the saved ``config`` ("-" where the method has no such choice)."""
    row = {"levels": None, "scheme": "-", "alpha": "-", "optimizer": "-", "budget": "-"}
    return {**row, **(METHODS[name].describe(config) if name in METHODS else {})}


def planned_ledger(cfg: RunConfig, name: str) -> dict:
    """The FLOPs, examples and tokens each phase of method ``name`` plans to spend (models built on
    the meta device), from the plan the runner executes. A transition's cost is read on the model
    of its level (the size the plan trains at that level)."""
    plan = build_plan(cfg, name)
    vocab = 50257 if cfg.data.tokenizer == "gpt2" else cfg.data.vocab_size
    family = FAMILIES[cfg.model.family]
    seq = task_of(cfg.task).seq_len(cfg)
    full = model_sizes(cfg)
    at_level = {item.level: item.sizes or full for item in plan if isinstance(item, Phase)}
    models: dict = {}

    def model_of(sizes):
        if sizes not in models:
            with torch.device("meta"), family.skip_init():
                models[sizes] = family.new(sizes, **model_options(cfg, vocab))
            family.tie(models[sizes])  # (skipped initialisation leaves a tied head untied)
        return models[sizes]

    b = cfg.train.batch_size
    phases, transitions = [], []
    for i, item in enumerate(plan):
        if isinstance(item, Phase):
            sizes = item.sizes or full
            model = model_of(sizes)
            taught = min(item.steps, item.teacher[1]) if item.teacher else 0  # steps of weight > 0
            teacher = eval_flops_per_example(model_of(item.teacher[2]), seq) if taught else 0.0
            phases.append({"phase": item.name, "level": item.level, "steps": item.steps,
                           "examples": item.steps * b, "tokens": item.steps * b * (seq or 1),
                           "flops": item.steps * b * train_flops_per_example(model, seq) + taught * b * teacher,
                           "params": sum(p.numel() for p in model.parameters()), "sizes": sizes})
        elif item.op in COSTS:
            flops, examples = COSTS[item.op](cfg, item, model_of(at_level.get(item.level, full)))
            if flops:
                transitions.append({"item": i, "op": item.op, "level": item.level, "flops": flops,
                                    "examples": examples})
    total = sum(p["flops"] for p in phases) + sum(t["flops"] for t in transitions)
    return {"method": name, "plan": plan, "phases": phases, "transitions": transitions, "flops": total}


def format_plan(cfg: RunConfig, name: str) -> str:
    """What ``mlresearch run CONFIG --method NAME --plan`` prints."""
    ledger = planned_ledger(cfg, name)
    base = planned_ledger(cfg, "baseline")["flops"]
    phases = iter(ledger["phases"])
    lines = [f"plan of {name} for {cfg.experiment} (seed {cfg.seed}), {cfg.train.batch_size} examples per step",
             f"{'':3}{'item':34} {'model':28} {'steps':>7} {'tokens':>14} {'FLOPs':>10}"]
    for i, item in enumerate(ledger["plan"], 1):
        if isinstance(item, Phase):
            p = next(phases)
            s = p["sizes"]
            model = f"{s.layers}L/{s.hidden}d/{s.heads}h, {p['params'] / 1e6:.2f}M"
            lines.append(f"{i:<3}{'train ' + item.name + f' (level {item.level})':34} {model:28} {p['steps']:>7,} "
                         f"{p['tokens']:>14,} {p['flops']:>10.3e}")
        else:
            spent = [t for t in ledger["transitions"] if t["item"] == i - 1]
            cost = f"  [{spent[0]['examples']:,} examples evaluated, {spent[0]['flops']:.3e} FLOPs]" if spent else ""
            lines.append(f"{i:<3}{item.describe()}{cost}")
    if any(isinstance(item, Phase) and item.trigger is not None for item in ledger["plan"]):
        lines.append("(a stage with a trigger ends early when it fires; the numbers assume it does not)")
    lines.append(f"total: {ledger['flops']:.3e} FLOPs = {ledger['flops'] / base:.3f} x the baseline's {base:.3e}")
    return "\n".join(lines)


H100_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's dense bf16 peak of an H100 SXM (the default --peak-tflops)


def format_cost(cfg: RunConfig, gpus: int = 8, peak_tflops: float = H100_BF16_DENSE_TFLOPS, mfu: float = 0.4) -> str:
    """What ``mlresearch plan CONFIG`` prints: each method the config can plan, its phases with
    tokens, FLOPs and estimated GPU-hours (FLOPs / (peak x MFU)), beside the baseline, and the saving
    each method's plan implies if it reaches the baseline's final loss at its own end."""
    if gpus < 1 or peak_tflops <= 0 or not 0 < mfu <= 1:
        raise ConfigError(f"--gpus must be >= 1, --peak-tflops > 0 and --mfu in (0, 1]; got {gpus}, {peak_tflops}, {mfu}")
    per_gpu_hour = peak_tflops * 1e12 * mfu * 3600

    def hours(flops: float) -> float:
        return flops / per_gpu_hour

    names = ["baseline"] + sorted(n for n in METHODS if n != "baseline")
    ledgers = {}
    for name in names:
        try:
            ledgers[name] = planned_ledger(cfg, name)
        except ConfigError:  # a method this config cannot plan (no vcycle section, say)
            continue
    base = ledgers["baseline"]["flops"]
    lines = [f"cost plan for {cfg.experiment}: {gpus} GPU(s) at {peak_tflops:g} TFLOP/s peak, MFU {mfu:g} "
             f"({gpus * peak_tflops * mfu:g} TFLOP/s sustained); {cfg.train.batch_size} examples per step"]
    for name, ledger in ledgers.items():
        lines.append(f"\n{name}:")
        lines.append(f"  {'phase':12} {'model':26} {'steps':>9} {'tokens':>16} {'FLOPs':>10} {'GPU-hours':>10}")
        for p in ledger["phases"]:
            s = p["sizes"]
            model = f"{s.layers}L/{s.hidden}d/{s.heads}h, {p['params'] / 1e6:.1f}M"
            lines.append(f"  {p['phase']:12} {model:26} {p['steps']:>9,} {p['tokens']:>16,} {p['flops']:>10.3e} "
                         f"{hours(p['flops']):>10,.1f}")
        for t in ledger["transitions"]:
            lines.append(f"  {t['op'] + str(t['level']):12} {'(forward passes)':26} {'':>9} {'':>16} {t['flops']:>10.3e} "
                         f"{hours(t['flops']):>10,.1f}")
        total = ledger["flops"]
        lines.append(f"  {'total':12} {'':26} {'':>9} {sum(p['tokens'] for p in ledger['phases']):>16,} "
                     f"{total:>10.3e} {hours(total):>10,.1f}  ({hours(total) / gpus:,.1f} h on {gpus} GPU(s))")
    lines.append("\nif a method reaches the baseline's final validation loss at the end of its plan:")
    for name, ledger in ledgers.items():
        if name != "baseline":
            saved = hours(base) - hours(ledger["flops"])
            lines.append(f"  {name}: {100 * (1 - ledger['flops'] / base):.1f}% of the baseline's FLOPs saved, "
                         f"{saved if abs(saved) >= 0.05 else 0.0:,.1f} GPU-hours")  # (no "-0.0")
    return "\n".join(lines)


def methods_markdown() -> str:
    """The README's methods list: one row per registered method, from its own ``Method`` entry."""
    lines = ["| method | `--method` | what it does | function kept at its transitions | costs besides its training steps |",
             "|---|---|---|---|---|"]
    for name, m in METHODS.items():
        lines.append(f"| {m.display()} | `{name}` | {m.summary} | {m.preserves or '-'} | {m.costs or '-'} |")
    return "\n".join(lines) + "\n"
