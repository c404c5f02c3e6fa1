"""The ``mlresearch`` command line.

    mlresearch run     CONFIG --method METHOD [--plan] [--baseline] [--out DIR] [--resume] [--set key=value]
    mlresearch compare BASELINE_RUN METHOD_RUN                           FLOPs/wall saving
    mlresearch study SPEC [--stage S] [--dry-run] [--launch CMD]          a study spec, resumable
    mlresearch table [--docs README.md docs/results.md]                  study tables from results/
    mlresearch downstream RUN_DIR... [--skip-done]                       downstream checks of finished runs
    mlresearch similarity --run DIR | --model DIR [--data CONFIG] --metric cka --out DIR
    mlresearch new gpt2 --out DIR --layers 4 --heads 4 --hidden 128 [--set vocab_size=8192]
    mlresearch plan CONFIG [--gpus N --peak-tflops X --mfu Y]             phases, FLOPs, GPU-hours per method
    mlresearch data prepare CONFIG [--num-proc N] [--out DIR]             tokenize once into token files (or render fractals)
    mlresearch check MODEL_DIR [--scheme FILE | --factor N]                 which operator promises hold
    mlresearch map coalesce    --src DIR --out DIR (--scheme FILE | --halving [--depth stack])
    mlresearch map decoalesce  --src DIR --out DIR (--scheme FILE | --halving [--depth stack])
    mlresearch map interpolate --src DIR --with DIR --out DIR (--alpha A | --adaptive [tensor|row])

Every output directory is written to a temporary sibling and renamed only on success.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

from .errors import MLResearchError


def _scheme_for(args: argparse.Namespace, model, down: bool):
    from .families import family_of
    from .operators import Scheme

    if args.scheme:
        return Scheme.from_json(args.scheme)
    depth = None if args.depth == "none" else args.depth
    if down:
        return Scheme.halving(model, width=not args.no_width, depth=depth)
    # De-coalescing with --halving: the scheme of the model twice this one's size.
    sizes = family_of(model).sizes(model)
    heads = sizes.heads * (1 if args.no_width else 2)
    layers = sizes.layers * (2 if depth else 1)
    return Scheme.halving(heads=heads, layers=layers, width=not args.no_width, depth=depth)


def _cmd_map(args: argparse.Namespace) -> int:
    from .checkpoint import load_model, save_model
    from .families import family_of
    from .operators import coalesce, decoalesce, interpolate

    _check_model_out(args)
    start = time.perf_counter()
    model = load_model(args.src)
    if args.op == "interpolate":
        other = load_model(getattr(args, "with"))
        adaptive = args.adaptive or False
        result = interpolate(model, other, alpha=args.alpha, adaptive=adaptive)
        what = f"adaptive ({adaptive})" if adaptive else f"alpha={args.alpha}"
    else:
        scheme = _scheme_for(args, model, down=args.op == "coalesce")
        result = (coalesce if args.op == "coalesce" else decoalesce)(model, scheme)
        what = f"scheme {scheme.to_dict()}"
    save_model(result, args.out, overwrite=args.overwrite)
    family = family_of(result)
    before, after = family.sizes(model), family.sizes(result)
    print(f"{args.op}: {args.src} -> {args.out} with {what}")
    print(f"  {before} -> {after}; {time.perf_counter() - start:.2f}s")
    return 0


def _check_model_out(args: argparse.Namespace) -> None:
    """Before any work: ``--out`` is free, or (``--overwrite``) a model directory this project wrote."""
    from .overwrite import MODEL, check_overwrite

    out = Path(args.out)
    if args.overwrite:
        check_overwrite(out, MODEL)
    elif out.exists() or out.is_symlink():
        raise FileExistsError(f"--out {out} already exists (pass --overwrite to replace a model directory there)")


def _cmd_plan(args: argparse.Namespace) -> int:
    from .training.config import load_config
    from .training.methods import format_cost

    print(format_cost(load_config(args.config, args.set), args.gpus, args.peak_tflops, args.mfu))
    return 0


def _prepare_images(settings: dict, args: argparse.Namespace) -> int:
    """``data prepare`` of an image config: render a generated set (fractals) into the data cache."""
    from .data.datasets import prepare_images
    from .training.config import ConfigError

    if args.out:
        raise ConfigError("--out: a generated image set goes to the data cache ($MLRESEARCH_CACHE), where runs find it")
    tick = time.perf_counter()
    path = prepare_images(settings, args.num_proc)
    if path is None:
        raise ConfigError(f"`data prepare` tokenizes text and renders generated image sets; data.corpus "
                          f"{settings.get('corpus')!r} is read where it is")
    print(f"prepared in {time.perf_counter() - tick:.1f} s (or found): {path}")
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from .data.prepare import is_prepared, open_prepared, prepare_text, prepared_dir
    from .training.config import load_config
    from .tasks import task_of
    from .training.models import data_settings

    cfg = load_config(args.config, args.set)
    settings = data_settings(cfg)
    if not task_of(cfg.task).sequences:
        return _prepare_images(settings, args)
    out = Path(args.out) if args.out else prepared_dir(cfg.task, settings, cfg.seed)
    existed = is_prepared(out)
    tick = time.perf_counter()
    path = prepare_text(cfg.task, settings, cfg.seed, num_proc=args.num_proc, out=out, progress=True)
    _, vocab, _, index = open_prepared(path, cfg.task, cfg.data.seq_len)
    print(f"{'already prepared' if existed else f'prepared in {time.perf_counter() - tick:.1f} s'}: {path}")
    print(f"{index['source']}, seed {index['seed']}, vocabulary {vocab} ({index['dtype']} token files)")
    for name, info in index["splits"].items():
        print(f"  {name:5} {info['documents']:>10,} documents {info['tokens']:>15,} tokens")
    if args.out and not cfg.data.prepared_dir:
        print(f"train from it with --set data.prepared_dir={path} (or data.prepared_dir in the config)")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import check_model, format_rows
    from .checkpoint import load_model
    from .operators import Scheme

    model = load_model(args.model_dir)
    if args.scheme:
        scheme = Scheme.from_json(args.scheme)
    else:
        scheme = Scheme.uniform(model, width_factor=args.factor, depth_factor=2)
    rows, what = check_model(model, scheme)
    print(f"check {args.model_dir} ({what})")
    print(format_rows(rows))
    failed = [r.operator for r in rows if r.held is False]
    print("every promised property holds" if not failed else f"NOT HELD: {', '.join(failed)}")
    return 1 if failed else 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _parse_setting(text: str) -> tuple[str, object]:
    from .checkpoint import DuplicateKey, parse_json

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, parse_json(value)
    except DuplicateKey as exc:
        raise argparse.ArgumentTypeError(f"--set {text!r}: {exc}") from None
    except json.JSONDecodeError:
        return key, value


def _cmd_new(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import save_model
    from .families import FAMILIES, Sizes
    from .training.config import ConfigError, ModelConfig

    options = dict(args.set)
    ModelConfig(args.family, args.layers, args.heads, args.hidden, args.ffn, args.kv_heads, options).validate()
    _check_model_out(args)
    torch.manual_seed(args.seed)
    sizes = Sizes(layers=args.layers, heads=args.heads, kv_heads=args.kv_heads or args.heads, hidden=args.hidden,
                  ffn=args.ffn or 4 * args.hidden, head_dim=args.hidden // args.heads)
    try:
        model = FAMILIES[args.family].new(sizes, **options)
    except Exception as exc:  # noqa: BLE001 -- HF and timm raise many types for a bad option value
        raise ConfigError(f"new {args.family}: cannot build it with --set {options}: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}") from None
    save_model(model, args.out, overwrite=args.overwrite)
    n = sum(p.numel() for p in model.parameters())
    print(f"new {args.family} ({type(model).__name__}, {n / 1e6:.2f} M params) -> {args.out}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .training.config import load_config
    from .training.methods import build_plan, format_plan
    from .training.record import finished as is_finished
    from .training.run import config_differences, default_out, run_method

    cfg = load_config(args.config, args.set)
    kind = args.method
    build_plan(cfg, kind)  # an unknown method, or one the config cannot plan, is an error here
    if args.plan:
        print(format_plan(cfg, kind))
        return 0
    out = Path(args.out) if args.out else default_out(cfg, kind, args.root)
    if is_finished(out) and not args.overwrite:
        changed = config_differences(out, cfg, kind)
        if args.skip_done:
            note = f" (WARNING: its config differs in {', '.join(changed)})" if changed else ""
            print(f"{kind}: {out} is complete (summary.json); skipped{note}")
            return 0
        finished = None if changed else json.loads((out / "summary.json").read_text())
    else:
        finished = None
    base_out = None
    if kind != "baseline" and args.baseline:
        base_out = default_out(cfg, "baseline", args.root)
        if is_finished(base_out) and not config_differences(base_out, cfg, "baseline"):
            print(f"baseline: reusing {base_out} (finished, same config)")
        else:
            _print_summary(run_method(cfg, "baseline", base_out, resume=base_out.exists()))
    if finished is not None:  # the same run, finished: report it rather than fail or train it again
        print(f"{kind}: reusing {out} (finished, same config; --overwrite trains it again)")
        _print_summary(finished)
    else:
        _print_summary(run_method(cfg, kind, out, resume=args.resume, overwrite=args.overwrite))
    if base_out is not None:
        from .training.compare import compare_runs, format_comparison

        print(format_comparison(compare_runs(base_out, out)))
    return 0


def _print_summary(summary: dict) -> None:
    val = summary["final_full_val"]
    extra = f", val acc {val['val_acc']:.4f}" if "val_acc" in val else ""
    print(f"{summary['kind']}: {summary['flops_total']:.3e} FLOPs, {summary['wall_total']:.1f} s, "
          f"full-validation loss {val['val_loss']:.4f}{extra}")


def _cmd_compare(args: argparse.Namespace) -> int:
    from .training.compare import compare_runs, format_comparison

    print(format_comparison(compare_runs(args.baseline, args.method)))
    return 0


def _cmd_similarity(args: argparse.Namespace) -> int:
    from .analysis.report import similarity_report

    out = similarity_report(args.out, run=args.run, model_dir=args.model, data=args.data, metric=args.metric,
                            examples=args.examples, overwrite=args.overwrite)
    print(f"similarity ({args.metric}) -> {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    return 0


def _cmd_downstream(args: argparse.Namespace) -> int:
    from .downstream import DownstreamConfig, evaluate_run

    chosen = {"finetune_steps": args.finetune_steps, "finetune_lr": args.finetune_lr}
    dc = DownstreamConfig(**{k: v for k, v in chosen.items() if v is not None})
    for run in args.runs:
        if args.skip_done and (Path(run) / "downstream.json").exists():
            print(f"downstream: {run} is done; skipped")
            continue
        r = evaluate_run(run, dc)
        shown = {k: r[k] for k in ("perplexity", "bits_per_byte", "accuracy") if k in r}
        print(f"downstream {run}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _cmd_study(args: argparse.Namespace) -> int:
    from .study_runner import run_study

    # Stopped with SIGTERM (kill, a scheduler's stop), the study unwinds like Ctrl-C: the run it waits on is
    # reaped and its CPU time recorded in cpu.json before the study exits (the run resumes next time).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        run_study(args.spec, args.stage, args.dry_run, args.launch, args.finished)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _cmd_table(args: argparse.Namespace) -> int:
    from .study import markdown, write_tables

    if not Path(args.results).is_dir():
        raise FileNotFoundError(errno.ENOENT, "--results names no directory of runs", args.results)
    docs = [*(args.docs or []), *([args.readme] if args.readme else [])]
    for path in docs:
        if not Path(path).is_file():
            raise FileNotFoundError(errno.ENOENT, "--docs / --readme names no file", path)
    from .study_runner import headlines

    table = write_tables(args.results, docs, headlines(args.results) if docs else None)
    print(markdown(table))
    print(f"wrote {args.results}/tables/" + (f" and the generated blocks of {', '.join(map(str, docs))}" if docs else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlresearch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure (or set MLRESEARCH_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    from .analysis.similarity import METRICS
    from .families import FAMILIES
    from .training.methods import METHODS

    p = sub.add_parser("run", help="run a method's plan (baseline, small-model control, V-cycle, ...)")
    p.add_argument("config", help="YAML config (experiments/configs/*.yaml)")
    p.add_argument("--method", required=True, choices=sorted(METHODS))
    p.add_argument("--plan", action="store_true",
                   help="print every phase and transition (model size, steps, tokens, planned FLOPs) and "
                        "the total, without training")
    p.add_argument("--out", help="run directory (default ROOT/<experiment>/<run>)")
    p.add_argument("--root", help="where default run directories go (default $MLRESEARCH_RUNS or ./runs; "
                                  "the committed study uses --root results)")
    p.add_argument("--resume", action="store_true", help="continue a killed run from its checkpoints")
    p.add_argument("--overwrite", action="store_true", help="start over in an existing run directory")
    p.add_argument("--skip-done", action="store_true", help="do nothing if the run already has its summary")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. train.steps=100")
    p.add_argument("--baseline", action="store_true",
                   help="also train (or reuse) the baseline and print the comparison")
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser("compare", help="FLOPs and wall time to reach the baseline's final validation loss")
    p.add_argument("baseline", help="the baseline's run directory")
    p.add_argument("method", help="the method's run directory")
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("downstream", help="downstream check of finished runs (zero-shot perplexity, BBC topic "
                                          "fine-tuning, test top-1) -> <run>/downstream.json")
    p.add_argument("runs", nargs="+", help="run directories with final_model/")
    p.add_argument("--skip-done", action="store_true", help="skip runs that already have downstream.json")
    p.add_argument("--finetune-steps", type=_positive_int, help="BBC fine-tuning steps (masked LM runs)")
    p.add_argument("--finetune-lr", type=_positive_float, help="BBC fine-tuning peak LR (masked LM runs)")
    p.set_defaults(func=_cmd_downstream)

    p = sub.add_parser("study", help="run a study spec (experiments/studies/*.yaml): the baseline tuned on the tuning "
                                     "split, every method on the same seeds, resumable; then the side-by-side table")
    p.add_argument("spec")
    p.add_argument("--stage", choices=("tune", "frontier", "regime", "all"), default="all",
                   help="tune: only the baseline's LR/warm-up; frontier: it and the baseline frontier; regime: it and "
                        "the regime check (baseline vs the small shape alone); all: every run and stage")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their state; train nothing")
    p.add_argument("--finished", action="store_true", help="train nothing; write the stages' tables (frontier.csv, "
                                                          "regime.csv) from the runs already finished")
    p.add_argument("--launch", help='start each run under this launcher, e.g. "torchrun --standalone --nproc_per_node 8" '
                                    "(default $MLRESEARCH_LAUNCH, else this Python, one process)")
    p.set_defaults(func=_cmd_study)

    p = sub.add_parser("table", help="study tables from every run in results/ (and README's Results)")
    p.add_argument("--results", default="results")
    p.add_argument("--docs", nargs="+", metavar="FILE",
                   help="also rewrite these files' generated blocks (<!-- answer:start --> ..., <!-- results:start --> ...)")
    p.add_argument("--readme", help="the same as --docs FILE, for one file")
    p.set_defaults(func=_cmd_table)

    p = sub.add_parser("similarity", help="inter/intra-layer similarity maps of a run or a model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="a run directory (its snapshots, or final model)")
    src.add_argument("--model", help="a model checkpoint directory")
    p.add_argument("--data", help="config file or preset name (e.g. gpt2_tiny) whose validation split is the "
                                  "probe (default: the run's config)")
    p.add_argument("--metric", choices=tuple(METRICS), default="cka")
    p.add_argument("--examples", type=_positive_int, default=16, help="validation examples in the probe batch")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_similarity)

    p = sub.add_parser("new", help="write a randomly initialised model of a given size")
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--ffn", type=int, help="default: 4 x hidden")
    p.add_argument("--kv-heads", type=int, help="key/value heads (llama GQA); default: heads")
    p.add_argument("--set", type=_parse_setting, action="append", default=[], metavar="KEY=VALUE",
                   help="any other config/constructor option, e.g. vocab_size=8192")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_new)

    from .training.methods import H100_BF16_DENSE_TFLOPS

    p = sub.add_parser("plan", help="each method's phases, tokens, FLOPs and estimated GPU-hours, before training")
    p.add_argument("config")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                   help=f"peak TFLOP/s of one GPU (default {H100_BF16_DENSE_TFLOPS:g}: H100 SXM, dense bf16)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation to assume (default 0.4)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("data", help="data preparation")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    q = data_sub.add_parser("prepare", help="split by document, tokenize with datasets.map(num_proc) and write the "
                                            "token files training reads in place")
    q.add_argument("config")
    q.add_argument("--num-proc", type=_positive_int, default=os.cpu_count() or 1,
                   help="tokenizing processes (default: all CPUs)")
    q.add_argument("--out", help="where to write (default: data.prepared_dir, else the data cache)")
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    q.set_defaults(func=_cmd_data_prepare)

    p = sub.add_parser("check", help="run every operator on a saved model and say which promised properties hold")
    p.add_argument("model_dir", help="a model directory (config.json + model.safetensors) of a supported family")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--scheme", help="scheme JSON (default: merge --factor heads and 2 layers into one)")
    g.add_argument("--factor", type=_positive_int, default=2, help="width factor of the default scheme (default 2)")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("map", help="apply an operator to checkpoint directories")
    ops = p.add_subparsers(dest="op", required=True)
    for op in ("coalesce", "decoalesce"):
        q = ops.add_parser(op, help=f"{op} a checkpoint")
        q.add_argument("--src", required=True, help="checkpoint directory (config.json + model.safetensors)")
        q.add_argument("--out", required=True, help="output directory")
        g = q.add_mutually_exclusive_group(required=True)
        g.add_argument("--scheme", help="scheme JSON ({'width_scheme': [[0,6],...], 'depth_scheme': [[0,1],...]})")
        g.add_argument("--halving", action="store_true", help="the paper's default halving scheme")
        q.add_argument("--depth", choices=("adjacent", "stack", "none"), default="adjacent",
                       help="with --halving: depth pairing (default: adjacent layers 2i, 2i+1)")
        q.add_argument("--no-width", action="store_true", help="with --halving: keep the width")
        q.add_argument("--overwrite", action="store_true")
    q = ops.add_parser("interpolate", help="(1-alpha)*SRC + alpha*WITH")
    q.add_argument("--src", required=True, help="the model before coalescing (M1)")
    q.add_argument("--with", required=True, help="the de-coalesced model")
    q.add_argument("--out", required=True)
    g = q.add_mutually_exclusive_group(required=True)
    g.add_argument("--alpha", type=float)
    g.add_argument("--adaptive", nargs="?", const="tensor", choices=("tensor", "row"),
                   help="normalise WITH's tensors to SRC's norms, then merge 0.5/0.5")
    q.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_map)
    return parser


def _resume_hint(args: argparse.Namespace, argv: Sequence[str]) -> str:
    if getattr(args, "command", None) == "run":
        again = [a for a in argv if a != "--overwrite"] + ([] if args.resume else ["--resume"])
        return f"; checkpoints are kept: continue with `mlresearch {shlex.join(again)}`"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("MLRESEARCH_DEBUG", "") not in ("", "0")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-shard bars add noise to one-line reports
        return args.func(args)
    except KeyboardInterrupt:
        print(f"\nmlresearch: interrupted{_resume_hint(args, argv)}", file=sys.stderr)
        return 130
    except Exception as exc:  # one line for the user; --debug for the traceback
        if debug:
            raise
        if isinstance(exc, (MLResearchError, ValueError, TypeError)):
            message = str(exc)
        elif isinstance(exc, OSError):
            message = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
            if getattr(exc, "errno", None) == errno.ENOSPC:
                message = (f"no space left on the device while writing {exc.filename or 'an output file'}; nothing "
                           "already written was lost (each file is written aside and renamed only when complete)")
        else:
            message = f"internal error {type(exc).__name__}: {exc} (rerun with --debug for the traceback)"
        message = " ".join(message.split())  # one line
        hint = _resume_hint(args, argv) if getattr(exc, "errno", None) == errno.ENOSPC else ""
        print(f"mlresearch: error: {message}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
