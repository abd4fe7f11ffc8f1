"""``sonar`` command line: train, eval, score, bench.

    sonar train [--config C ...] [key=value ...]        # default: the tiny preset; C: a file or a preset name
    sonar config show|validate [--config C ...] [key=value ...]
    sonar config list                                  # the shipped presets
    sonar config fields [PREFIX ...]                   # every field: type, default, range, description
    sonar index [--config C ...] [--resume] [--dense] [key=value ...] # build the retrieval index (no Ray)
    sonar --version
    sonar eval [--config C ...] --checkpoint DIR --data FILE [--data FILE2 ...] [--format F] [key=value ...]
                                                       # a run's checkpoint: searched in that run's world
    sonar score PREDICTIONS.jsonl [...] [--pred-field F --gold-field G]
    sonar bench NAME [--quick] [...]
    sonar chaos --config C --steps N [--kill-every K] [--minutes M] [--seed S] [--compare] [key=value ...]
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from sonar.cluster.wire.config import DEFAULT_CONFIG, ConfigError, load_config
from sonar.cluster.wire.paths import CONFIG_HELP


def _env_defaults() -> None:
    # Before torch/ray are imported: one thread per process, Ray on loopback, no hub access.
    for k, v in {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        os.environ.setdefault(k, v)
    if not sys.stderr.isatty():  # a log file or a pipe: Ray prints its workers' lines without colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _load(args, notes: list | None = None) -> "Config":
    overrides = list(args.overrides)
    if getattr(args, "cmd", None) in ("index", "eval"):
        # Nothing is trained on the config's stages here (eval reads its --data files): the refusal of RL
        # on the toy world with a real corpus or model (world.force) does not apply.
        overrides.append("world.force=true")
    try:
        return load_config(args.config or [DEFAULT_CONFIG], overrides, notes=notes)
    except (ConfigError, ValueError) as e:
        _config_error(e)
        raise SystemExit(2)


def _config_error(e: Exception) -> None:
    msg = " ".join(str(e).split())  # one line, whatever the message held
    print(f"sonar: config error: {msg}", file=sys.stderr)
    plan = getattr(e, "plan", None)  # a memory-plan refusal (memory.MemoryPlanError): the whole plan below
    if plan is not None:
        print(plan.format(), file=sys.stderr)


def memory_plan_text(cfg) -> str:
    """The GPU memory plan as printed (``cluster/wire/memory.py``), the "memory plan not checked: ..." line
    when the model's config.json is not on this machine, or "" when the run uses no GPU (then nothing is
    imported: the plan needs torch and transformers)."""
    if not (cfg.learner.num_gpus > 0 or cfg.rollout.num_gpus_per_worker > 0):
        return ""
    from sonar.cluster.wire.memory import describe

    return describe(cfg)


def _version() -> str:
    """The imported package's ``__version__`` and folder: under a job from a checkout, the checkout's
    (``cluster/driver/jobs.py``), which the installed distribution's metadata would not say."""
    from pathlib import Path

    import sonar

    return f"{sonar.__version__} from {Path(sonar.__file__).resolve().parent}"


def config_command(args) -> int:
    """``sonar config show|validate|list|fields|recipes``: nothing is started, no directory is written."""
    from sonar.cluster.wire.config import to_yaml
    from sonar.cluster.wire.paths import preset_summary, presets

    if args.config_cmd == "recipes":  # the README's recipe tables: each preset beside the released scripts
        from sonar.cluster.wire.recipes import RECIPES, markdown

        names = args.names or list(RECIPES)
        unknown = [n for n in names if n not in RECIPES]
        if unknown:
            print(f"sonar: no recipe table for {', '.join(unknown)} (recipes: {', '.join(RECIPES)})", file=sys.stderr)
            return 2
        print("\n".join(markdown(n, _load_recipe(n)) for n in names), end="")
        return 0
    if args.config_cmd == "fields":
        return _print_fields(args.prefixes)
    if args.config_cmd == "list":
        found = presets()
        width = max((len(n) for n in found), default=0)
        for name, path in found.items():
            print(f"{name:<{width}}  {preset_summary(path)}")
        from sonar.cluster.wire.config import BUILTIN_NAMES, DATA_FORMATS
        from sonar.cluster.wire.plugins import FIELDS

        print("\nplug-in fields: a built-in name, or a plug-in 'module.path:attr' / 'path/to/file.py:attr' "
              "(actors/README.md: Your own reward, tool, retriever and data)")
        for kind, (fld, signature) in FIELDS.items():
            names = BUILTIN_NAMES.get(kind) or tuple(f for f in DATA_FORMATS if f != "auto")
            print(f"  {fld:<28} {kind}: {signature}\n  {'':<28} built-in: {', '.join(names)}")
        return 0
    # Files on the cluster's storage (model.path, dataset files) are noted, not refused: these verbs run on
    # a laptop too (``config.not_checked``); ``sonar train`` refuses them.
    notes: list = []
    cfg = _load(args, notes)  # exits 2 with the field and value on an error
    tail = [f"not checked here: {n}" for n in notes]
    plan = memory_plan_text(cfg)
    if plan:
        tail += plan.splitlines()
    if args.config_cmd == "show":
        print(to_yaml(cfg), end="")
        if tail:  # as YAML comments: the output stays a loadable config
            print("\n".join(f"# {line}" for line in tail))
    else:
        print(f"sonar: config ok ({', '.join(map(str, args.config or [DEFAULT_CONFIG.stem]))}"
              f"{' + ' + str(len(args.overrides)) + ' overrides' if args.overrides else ''})")
        if tail:
            print("\n".join(tail))
    return 0


def _print_fields(prefixes: list[str]) -> int:
    """``sonar config fields [PREFIX ...]``: each field's key, type, default and range, then its whole
    description, all read from the schema (the range from the field's metadata, the description from its
    docstring), so this listing cannot drift from what is checked."""
    import json
    import textwrap

    from sonar.cluster.wire.config import describe_fields

    rows = describe_fields(prefixes)
    if not rows:
        print(f"sonar: no config field is or starts with {', '.join(prefixes)} (sections: run, world, model, "
              "protocol, retrieval, rollout, learner, critic, replay, stages.N, eval, tracking, cluster)",
              file=sys.stderr)
        return 2
    for key, typ, default, rng, doc in rows:
        print(f"{key}: {typ} = {json.dumps(default)}" + (f"  ({rng})" if rng is not None else ""))
        if doc:
            print(textwrap.fill(doc, width=100, initial_indent="    ", subsequent_indent="    "))
    return 0


def _load_recipe(name: str):
    """A recipe preset as shipped (its files on the cluster's storage noted, not refused)."""
    from sonar.cluster.wire.config import load_config

    return load_config([name], notes=[])


def _sigterm_as_interrupt() -> None:
    """`ray job stop` and schedulers send SIGTERM: treat it like Ctrl-C (MLflow run KILLED, actors killed,
    Ray shut down). The interrupt carries when the signal came (``signal_at``, monotonic seconds): the
    driver logs how long marking the run KILLED took, which must fit in Ray's stop wait (3 s by default)."""
    import time

    def handler(signum, frame):
        e = KeyboardInterrupt(f"signal {signum}")
        e.signal_at = time.monotonic()
        raise e

    signal.signal(signal.SIGTERM, handler)


def build_parser() -> argparse.ArgumentParser:
    """The `sonar` command line (score, chaos and bench parse their own arguments)."""
    # RawDescriptionHelpFormatter: argparse would wrap the --version line (a folder path) at the terminal width
    p = argparse.ArgumentParser(prog="sonar", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"sonar {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True, help="the command (sonar VERB --help: its options)")
    t = sub.add_parser("train", help="train (default: the tiny preset)")
    t.add_argument("--config", action="append", help=CONFIG_HELP)
    t.add_argument("overrides", nargs="*", help="key=value overrides")
    e = sub.add_parser("eval", help="greedy evaluation of a checkpoint over dataset files")
    e.add_argument("--config", action="append",
                   help=CONFIG_HELP + ". A checkpoint inside a training run is evaluated in that run's world: "
                   "without --config the run's saved config.yaml (then key=value); with it, the files give the "
                   "evaluation settings but world.*, model.*, protocol.name and retrieval.* (but retrieval.k) stay "
                   "the run's. key=value overrides win over both, except protocol.name, "
                   "model.path and model.tags, which must equal the run's")
    e.add_argument("--checkpoint", required=True,
                   help="Sonar checkpoint, run directory or Hugging Face model directory; the corpus and "
                        "retriever it is searched with are logged and printed")
    e.add_argument("--data", action="append", required=True, help="dataset file (repeatable)")
    e.add_argument("--format", default="auto", dest="fmt",
                   help="format of the --data files when detection cannot tell: flashrag, hotpotqa, 2wiki, musique, "
                        "bamboogle, r1_searcher, verl (aliases: search_r1, rag_r1, parquet, ...); default auto")
    e.add_argument("--out", default=None, help="output directory (default: <run>/eval-<stamp> for a checkpoint of a "
                   "training run, else <run.root>/eval-<stamp>; the path is printed)")
    e.add_argument("overrides", nargs="*", help="key=value overrides")
    c = sub.add_parser("config", help="print, check or list configs without running anything")
    c_sub = c.add_subparsers(dest="config_cmd", required=True, help="what to do with the config")
    for verb, text in (("show", "print the resolved config as YAML"),
                       ("validate", "load and check the config; exit 0, or 2 naming the field")):
        v = c_sub.add_parser(verb, help=text)
        v.add_argument("--config", action="append", help=CONFIG_HELP)
        v.add_argument("overrides", nargs="*", help="key=value overrides")
    fl = c_sub.add_parser("fields", help="every config field: type, default, valid range and description")
    fl.add_argument("prefixes", nargs="*", metavar="PREFIX",
                    help="only the fields whose key is or starts with PREFIX (a section such as learner, or "
                         "stages.N.algo); default: all")
    c_sub.add_parser("list", help="the shipped presets (`--config NAME`) with their first comment line, and the plug-in fields")
    rc = c_sub.add_parser("recipes", help="the paper recipes field by field beside the released scripts (Markdown)")
    rc.add_argument("names", nargs="*", help="r1_searcher, search_r1, rag_r1 (default: all)")
    ix = sub.add_parser("index", help="build the retrieval index (tantivy or Elasticsearch) of a config, no Ray")
    ix.add_argument("--config", action="append", help=CONFIG_HELP)
    ix.add_argument("--resume", action="store_true",
                    help="finish an interrupted build from its last committed batch (refused without it)")
    ix.add_argument("--dense", action="store_true",
                    help="also encode every passage (retrieval.dense) beside the index, in resumable, checksummed "
                         "shards: what retrieval.backend=dense searches (implied by it)")
    ix.add_argument("overrides", nargs="*", help="key=value overrides")
    sub.add_parser("score", help="score predictions JSONL files")
    sub.add_parser("bench", help="run a benchmark from bench/")
    sub.add_parser("chaos", help="train while killing workers, the search service and the learner; account for every prompt")
    return p


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    _sigterm_as_interrupt()
    from sonar.cluster.wire.logs import configure_logging

    configure_logging()  # the one log line format (cluster/wire/logs.py), libraries restamped as they load
    argv = list(sys.argv[1:] if argv is None else argv)
    from sonar.cluster.driver.jobs import reexec_from_checkout

    reexec_from_checkout(argv)  # under `ray job submit --working-dir <checkout>`: run the checkout's code
    if argv and argv[0] == "score":
        from sonar.actors.scoring import main as score_main

        return score_main(argv[1:])
    if argv and argv[0] == "chaos":
        from sonar.cluster.driver.chaos import main as chaos_main

        return chaos_main(argv[1:])
    if argv and argv[0] == "bench":
        from sonar.bench.run import main as bench_main

        return bench_main(argv[1:])
    p = build_parser()
    args = p.parse_args(argv)
    if args.cmd == "config":
        return config_command(args)
    if args.cmd == "eval":
        return eval_command(args)
    cfg = _load(args)
    if args.cmd == "index":
        from sonar.cluster.driver.indexing import main as index_main

        return index_main(cfg, args.resume, args.dense)
    if args.cmd == "train":
        from sonar.cluster.driver.loop import train
        from sonar.cluster.driver.run import ResumeError
        from sonar.cluster.wire.errors import RunFault, one_line
        from sonar.retrieval.factory import SearchServiceDown

        plan = memory_plan_text(cfg)
        if plan:
            logging.getLogger("sonar").info("%s", plan)

        try:
            train(cfg)
        except ResumeError as e:  # checked before Ray, a run directory or an MLflow run: one line
            print(f"sonar: resume error: {e}", file=sys.stderr)
            return 2
        except SearchServiceDown as e:  # checked before any learner or worker started: one line, the address
            print(f"sonar: search service error: {e}", file=sys.stderr)
            return 2
        except RunFault as e:  # a role or a resource, named in the message; the traceback is in error.log
            print(f"sonar: run failed: {one_line(e)} (traceback in {getattr(e, 'error_log', 'the run directory')})",
                  file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("sonar: interrupted; MLflow run marked KILLED, Ray shut down", file=sys.stderr)
            return 130
        return 0
    return 2


def eval_command(args) -> int:
    """``sonar eval``: the config from the checkpoint's run or ``--config`` (``evaluate.eval_config``), then
    ``evaluate.run_eval``. User errors are one line and exit 2; a failure part-way exits 1."""
    from sonar.actors.datasets import DatasetError
    from sonar.cluster.driver.evaluate import EvalError, EvalFailed, eval_config, run_eval
    from sonar.retrieval.corpus import CorpusError

    notes: list = []  # files eval never reads (training data, model.path on the cluster's storage): noted
    try:
        cfg, source = eval_config(args.checkpoint, args.config, list(args.overrides), notes=notes)
    except EvalError as e:  # an override that cannot fit the run's checkpoint: field, both values
        print(f"sonar: eval error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as e:
        _config_error(e)
        return 2
    for n in notes:
        logging.getLogger("sonar.eval").info("config: not checked here: %s", n)
    try:
        run_eval(cfg, args.checkpoint, args.data, args.out, fmt=args.fmt, source=source)
    except DatasetError as e:  # names the file, line and field: no traceback needed
        print(f"sonar: data error: {e}", file=sys.stderr)
        return 2
    except (EvalError, CorpusError) as e:  # names the file (checkpoint, weights, corpus)
        print(f"sonar: eval error: {e}", file=sys.stderr)
        return 2
    except EvalFailed as e:  # part-way: finished datasets kept, MLflow run FAILED, traceback in error.log
        print(f"sonar: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sonar: interrupted; MLflow run marked KILLED, finished datasets kept", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
