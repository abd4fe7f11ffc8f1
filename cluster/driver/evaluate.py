"""``sonar eval``: greedy evaluation of a policy over dataset files, with retrieval in the loop.

It runs the evaluation path of training (``actors/evaluation.py``: greedy ``rollout_groups``, one
sample per question, the same records and the same summary), in-process, over each dataset, and
reports EM, F1, cover-EM, searches, tokens and latency per question. It writes
``predictions-<name>.jsonl`` (question, golden answers, prediction, its scores, full decoded
trace) and ``eval.md`` (a Markdown table), and logs the summaries to MLflow as ``eval/<name>/...``.

What it measured it keeps, and what it refuses it refuses early:

* every dataset file is loaded and parsed, and the policy directory's files checked, before any
  model work and before anything is written (a bad file is one ``EvalError``/``DatasetError`` line
  naming it);
* output names are unique: ``<stem>``, or ``<dataset>-<split>`` for FlashRAG's
  ``<dataset>/<split>.jsonl`` layout (``hotpotqa/dev.jsonl`` -> ``hotpotqa-dev``), with more of the
  path where two files would still share a name (:func:`dataset_names`);
* each dataset's predictions file and table row are written (and logged) as soon as it finishes; a
  failure after that marks the MLflow run FAILED (KILLED on Ctrl-C), keeps the finished datasets'
  results and raises ``EvalFailed`` naming the dataset, with the traceback in ``<out>/error.log``.

The policy is a Hugging Face model directory, a Sonar checkpoint (its ``hf/`` export), or a run
directory (its final ``model/``).

Which world it searches (:func:`eval_config`). A checkpoint inside a training run (a directory holding
the ``config.yaml`` the run saved, beside its ``mlflow.json`` or ``metrics.jsonl``) is evaluated in that
run's world, not in whatever ``--config`` describes:

* without ``--config``: the config is the run's saved config, then the ``key=value`` overrides (the run's
  training data, ``stages.N.data`` and ``eval.data``, is not read: eval reads ``--data``);
* with ``--config``: the files (and overrides) give the evaluation settings as before (``eval.*``, the
  prompt, turn and token budgets, ``retrieval.k``, the reward that scores, tracking, ``run.root``), but
  the fields of :data:`RUN_WORLD` stay the run's whatever a file says: the synthetic world, the model and
  its tokenizer, the protocol's tag set, and the retriever (``retrieval.*`` but ``k``: backend, corpus,
  index, reranker); the fields a file gave otherwise are logged;
* a ``key=value`` override wins over both (``retrieval.corpus=other.jsonl`` searches another corpus),
  except where it cannot fit the checkpoint (:data:`MUST_FIT`: ``protocol.name``, ``model.path``,
  ``model.tags`` other than the run's are refused with an ``EvalError`` naming the field, the run's
  value and the override's).

A checkpoint that is not inside a run uses ``--config`` (default: the tiny preset) as it is. Either way
the corpus and retriever searched, and the config they came from, are logged at the start, printed at
the end (``sonar eval: searching ...``) and logged to MLflow (``eval.searched``, ``eval.config``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import traceback
from pathlib import Path

from sonar.cluster.wire.config import Config, flatten, to_dict, to_yaml
from sonar.cluster.wire.logs import run_stamp

log = logging.getLogger("sonar.eval")

SPLIT_STEMS = frozenset({"train", "dev", "test", "val", "valid", "validation", "eval"})
"""File stems that name a split, not a dataset (FlashRAG's ``<dataset>/<split>.jsonl``): the
directory is part of the output name."""
_DATA_SUFFIXES = (".gz", ".jsonl", ".json", ".parquet")


class EvalError(ValueError):
    """A user error found before evaluation starts (checkpoint, policy files, arguments); one line
    that names the file."""


class EvalFailed(RuntimeError):
    """Evaluation failed part-way: names the dataset, where the finished datasets' results are and
    where the traceback is. ``finished``: the table of the datasets that completed."""

    def __init__(self, message: str, finished: dict):
        super().__init__(message)
        self.finished = finished


def _stem(path: Path) -> str:
    name = path.name
    while (suffix := next((s for s in _DATA_SUFFIXES if name.endswith(s) and len(name) > len(s)), None)):
        name = name[:-len(suffix)]
    return name


def dataset_names(paths: list[str | Path]) -> list[str]:
    """A unique output name per data file, in order: the stem (``nq.jsonl`` -> ``nq``), with the
    parent directory first when the stem is a split (``hotpotqa/dev.jsonl`` -> ``hotpotqa-dev``), and
    more parent directories for the files that would still share a name. Characters MLflow keys
    refuse become ``_``. The same file given twice raises ``EvalError`` naming it."""
    from sonar.actors.datasets import DatasetError

    paths = [Path(p) for p in paths]
    seen: dict[Path, Path] = {}
    for p in paths:
        r = p.resolve()
        if r in seen:
            raise DatasetError(f"{p}: given twice as --data (also as {seen[r]})")
        seen[r] = p
    parts = [[*(d for d in p.resolve().parent.parts if d not in ("/", "")), _stem(p)] for p in paths]
    depth = [1 + (parts_[-1].lower() in SPLIT_STEMS) for parts_ in parts]

    while True:
        raw = [tuple(parts[i][-depth[i]:]) for i in range(len(paths))]
        clash = [i for i, n in enumerate(raw) if raw.count(n) > 1 and depth[i] < len(parts[i])]
        if not clash:
            break
        for i in clash:
            depth[i] += 1
    names = [re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(r)) for r in raw]
    # full paths that sanitise alike ("a b/x" and "a_b/x"): the second and later are numbered
    return [n if i == names.index(n) else f"{n}-{names[:i].count(n) + 1}" for i, n in enumerate(names)]


def resolve_model_dir(checkpoint: str) -> Path:
    p = Path(checkpoint)
    for cand in (p, p / "hf", p / "model"):
        if (cand / "config.json").is_file():
            return cand
    if (p / "checkpoints" / "latest").is_file():
        return resolve_model_dir(str(p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()))
    raise FileNotFoundError(f"--checkpoint {checkpoint!r}: no Hugging Face model directory there "
                            "(looked for config.json in it, in hf/ and in model/)")


def checkpoint_step(model_dir: Path, train_dir: Path | None) -> int:
    """The training run's step a policy directory holds, for its evaluation's metrics (MLflow charts them by
    step beside the run's own): a checkpoint's ``run_step`` (``<tag>/state.json`` beside its ``hf/``), else
    the training run's last logged step (its final ``model/``), else 0 (a policy from elsewhere)."""
    state = model_dir.parent / "state.json"
    try:
        if state.is_file():
            return int(json.loads(state.read_text()).get("run_step", 0))
        rows = (train_dir / "metrics.jsonl").read_text().splitlines() if train_dir is not None else []
        return max((int(json.loads(r).get("step", 0)) for r in rows if r.strip()), default=0)
    except (OSError, ValueError, TypeError):  # unreadable records: the step is unknown, the evaluation still runs
        return 0


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def check_policy_files(model_dir: Path) -> None:
    """Refuse, naming the file, a policy directory whose JSON files do not parse or whose safetensors
    weights are unreadable (bad header, truncated data): found before any model work. Raises EvalError."""
    for f in sorted(model_dir.glob("*.json")):
        try:
            json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise EvalError(f"{f}: not a readable JSON file ({_one_line(e)})") from None
    weights = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    if not weights:
        raise EvalError(f"--checkpoint {model_dir}: no weights file (*.safetensors or *.bin) in it")
    from safetensors import safe_open

    for f in weights:
        if f.suffix != ".safetensors":
            continue
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    st.get_slice(key)  # checks each tensor's byte range against the file
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise EvalError(f"{f}: corrupt weights file ({_one_line(e)})") from None


def _load_policy(model_dir: Path):
    from sonar.actors.model import load_policy

    check_policy_files(model_dir)
    try:
        return load_policy(model_dir)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises, name the directory
        raise EvalError(f"--checkpoint {model_dir}: cannot load the policy ({_one_line(e)})") from None


RUN_WORLD = ("world", "model", "protocol.name", "retrieval")
"""Config fields (sections or dotted fields) that say what a training run's checkpoint was trained in: the
synthetic world (its corpus, and the tiny policy's vocabulary), the model and its tokenizer, the
protocol's tag set, and the retriever (backend, corpus, index, reranker, service), all but
:data:`EVAL_SETS`. ``sonar eval`` of the run's checkpoint takes them from the run's saved config even where
a ``--config`` file says otherwise; a ``key=value`` override changes them (within :data:`MUST_FIT`)."""

EVAL_SETS = ("retrieval.k",)
"""Fields under :data:`RUN_WORLD` that a ``--config`` file still sets: the search depth, which an evaluation
overlay chooses with ``protocol.docs_per_query`` (``configs/r1_searcher_eval.yaml``: top 5)."""

MUST_FIT = {"protocol.name": "the policy was trained to write that protocol's tags",
            "model.path": "the checkpoint is its own model and tokenizer, not another family's",
            "model.tags": "the checkpoint's tokenizer holds the tags as the run put them there"}
"""Fields an override may not set to anything but the run's value (field -> why): a checkpoint of the run
cannot be evaluated otherwise."""

_RUN_MARKERS = ("mlflow.json", "metrics.jsonl")
"""Files beside ``config.yaml`` that make a directory a training run's (``tracking.RUN_FILE``, and the
metric rows a run with tracking off still writes)."""


def run_config_file(checkpoint: str | Path, levels: int = 4) -> Path | None:
    """The ``config.yaml`` the training run ``checkpoint`` lies in saved: ``checkpoint`` or the nearest of its
    ``levels`` parents (``<run>``, ``<run>/model``, ``<run>/checkpoints/<tag>/hf``) holding ``config.yaml``
    beside ``mlflow.json`` or ``metrics.jsonl``; None outside a run."""
    p = Path(checkpoint).expanduser().resolve()
    for d in [p, *p.parents][:levels + 1]:
        if (d / "config.yaml").is_file() and any((d / m).is_file() for m in _RUN_MARKERS):
            return d / "config.yaml"
    return None


def _field(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _with_field(obj, dotted: str, value):
    head, _, rest = dotted.partition(".")
    return dataclasses.replace(obj, **{head: _with_field(getattr(obj, head), rest, value) if rest else value})


def _leaves(obj, prefix: str) -> dict:
    """``{dotted field: value}`` of every leaf under ``prefix`` (a section's fields, recursively)."""
    if not dataclasses.is_dataclass(obj):
        return {prefix: obj}
    out: dict = {}
    for f in dataclasses.fields(obj):
        out.update(_leaves(getattr(obj, f.name), f"{prefix}.{f.name}"))
    return out


def _training_data_unset(saved: Path) -> list[str]:
    """Overrides that unset the run's training and held-out data files (``stages.N.data``, ``eval.data``):
    eval reads its ``--data``, and a training file missing here (a relative path, another machine) must not
    refuse it."""
    import yaml

    try:
        raw = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return []  # load_config names the file and what is wrong with it
    stages = raw.get("stages") if isinstance(raw, dict) else None
    n = len(stages) if isinstance(stages, list) else 0
    return [*(f"stages.{i}.data=null" for i in range(n)), "eval.data=null"]


def eval_config(checkpoint: str | Path, config_files: list[str] | None, overrides: list[str],
                notes: list | None = None) -> tuple[Config, str]:
    """The config ``sonar eval`` runs with, and where it came from (a phrase for the log). The rule (the
    module docstring): a checkpoint inside a training run is evaluated in the run's world -- without
    ``config_files`` the run's saved config plus ``overrides``; with them, the files plus ``overrides``,
    the fields of :data:`RUN_WORLD` that no override names put back to the run's (each one a file changed
    is logged); an override of a :data:`MUST_FIT` field to another value than the run's raises EvalError
    (field, the run's value, the override's). Outside a run: ``config_files`` (default the tiny preset) plus
    ``overrides``, as before. ``world.force=true`` is added either way: nothing is trained here (the toy
    world's refusal of a real corpus or model does not apply). Raises ConfigError / ValueError (a bad file or
    value) or EvalError."""
    from sonar.cluster.wire.config import DEFAULT_CONFIG, load_config, validate

    files = list(config_files or [])
    overrides = [*overrides, "world.force=true"]
    saved = run_config_file(checkpoint)
    if saved is None:
        from sonar.cluster.driver import tracking

        run_dir = tracking.find_run_dir(checkpoint)
        if run_dir is not None:
            log.warning("sonar eval: the run %s saved no config.yaml; its world is not known here, so the one "
                        "--config describes is searched", run_dir)
        cfg = load_config(files or [DEFAULT_CONFIG], overrides, notes=notes)
        return cfg, (f"--config {' '.join(map(str, files))}" if files else f"the default config {DEFAULT_CONFIG.name}")
    unset = _training_data_unset(saved)
    run_cfg = load_config([saved], [*unset, "world.force=true"], notes=notes)
    source = f"the run's config {saved}"
    if not files:
        cfg = load_config([saved], [*unset, *overrides], notes=notes)
    else:
        cfg = load_config(files, overrides, notes=notes)
        named = [o.partition("=")[0].strip() for o in overrides]
        kept = []
        for prefix in RUN_WORLD:
            for key, value in _leaves(_field(run_cfg, prefix), prefix).items():
                if any(key == n or key.startswith(n + ".") for n in [*named, *EVAL_SETS]):
                    continue  # an override names it (its value stands), or an evaluation setting
                given = _field(cfg, key)
                if given != value:
                    kept.append(f"{key}={value!r} (--config: {given!r})")
                    cfg = _with_field(cfg, key, value)
        if kept:
            log.info("sonar eval: the run's world kept over --config (a key=value override changes it): %s",
                     "; ".join(kept))
            cfg = validate(cfg, notes=notes)
        source += f", evaluation settings from --config {' '.join(map(str, files))}"
    for key, why in MUST_FIT.items():
        ran, now = _field(run_cfg, key), _field(cfg, key)
        if now != ran:
            raise EvalError(f"{key}={now!r} does not fit the checkpoint {checkpoint}: its run trained with "
                            f"{key}={ran!r} ({saved}); {why}")
    return cfg, source


def searched(cfg: Config, corpus: str | None, source: str) -> str:
    """``<corpus> (<backend>[ + <rerank> rerank], from <source>)``: what ``sonar eval`` searches."""
    from sonar.cluster.wire.redact import redact

    r = cfg.retrieval
    if corpus is None:
        what = f"the corpus of the retrieval server {redact(r.http.url)}"
    elif r.corpus:
        what = str(corpus)
    else:
        what = f"the synthetic world's corpus {corpus}"
    how = r.backend + (f" + {r.rerank} rerank" if r.rerank != "none" else "")
    return f"{what} ({how}, from {source})"


def _default_corpus(cfg: Config) -> str:
    from sonar.cluster.driver.roles import prepare_corpus

    return prepare_corpus(cfg, None)


def unknown_share(tokenizer, questions: list[str]) -> float:
    """The share of the questions' tokens that ``tokenizer`` maps to its unknown token (0 without one): a
    tiny world's word-level policy reads every word outside its vocabulary as ``<unk>``."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return 0.0
    ids = [t for q in questions for t in tokenizer.encode(q, add_special_tokens=False)]
    return sum(1 for t in ids if t == unk) / len(ids) if ids else 0.0


def run_eval(cfg: Config, checkpoint: str, data_files: list[str], out_dir: str | None = None,
             fmt: str = "auto", source: str | None = None) -> dict:
    """Evaluate the policy at ``checkpoint`` on each of ``data_files``; returns {name: summary}, names
    from :func:`dataset_names`. ``out_dir``: where everything is written; default ``<run>/eval-<stamp>`` when
    ``checkpoint`` lies in a training run (its ``mlflow.json``), else ``<run.root>/eval-<stamp>``.

    ``fmt``: the files' format (``actors.datasets.FORMATS``, an alias or a dataset plug-in; ``--format``), for files whose
    format detection cannot tell; "auto" detects per file. Every file is loaded (and a malformed one
    refused, naming file, line and field) and the policy's files checked before the policy is loaded
    or anything written. Raises DatasetError / EvalError (user errors, nothing written) or EvalFailed
    (after the output directory exists; finished datasets kept, MLflow run FAILED). ``source``: where
    ``cfg`` came from, for the ``searching`` line (:func:`eval_config`'s second value); None: "the config
    given"."""
    from tqdm import tqdm

    from sonar.actors import evaluation
    from sonar.actors.datasets import load_datasets
    from sonar.actors.tools import build_tools
    from sonar.actors.engine import HFEngine
    from sonar.actors.prompts import get_protocol
    from sonar.actors.rollout import PromptItem
    from sonar.cluster.driver import tracking
    from sonar.retrieval.factory import build_retriever

    names = dataset_names(data_files)
    # a format, "auto" or a dataset plug-in (``--format file.py:load``), or eval.fields' mapping
    datasets = [(name, path, load_datasets([path], fmt=fmt, fields=dict(cfg.eval.fields)))
                for name, path in zip(names, data_files)]
    try:
        model_dir = resolve_model_dir(checkpoint)
    except FileNotFoundError as e:
        raise EvalError(str(e)) from None
    model, tokenizer = _load_policy(model_dir)
    for name, _, items in datasets:
        share = unknown_share(tokenizer, [it.question for it in items])
        if share > 0:
            log.warning("dataset %s: %.1f %% of its question tokens are unknown to the policy's tokenizer (read as "
                        "%s); a policy trained on the synthetic world cannot read it", name, 100 * share,
                        tokenizer.unk_token)
    engine = HFEngine(model, eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer)  # stop strings: tags as text
    tags = get_protocol(cfg.protocol.name)
    corpus = cfg.retrieval.corpus or _default_corpus(cfg)
    retriever = build_retriever(cfg.retrieval, corpus, str(Path(cfg.run.root).resolve() / "index"))
    where = searched(cfg, corpus, source or "the config given")
    log.info("sonar eval: searching %s", where)
    # A training run's checkpoint: its results beside its run (<run>/eval-<stamp>); any other policy
    # directory: under run.root (./runs of the current directory unless configured).
    train_dir = tracking.find_run_dir(model_dir)
    step = checkpoint_step(model_dir, train_dir)  # the metrics land at the training step the policy is from
    out = Path(out_dir or (train_dir or Path(cfg.run.root)) / f"eval-{run_stamp()}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    # The training run's MLflow store when the checkpoint is one's (unless a store is named), else the
    # project's; tagged with (and nested under) the training run of the checkpoint.
    run_name = out.name if out.name.startswith("eval-") else f"eval-{out.name}"  # never "eval-eval-..."
    sink = tracking.make_sink(cfg, out, run_name, tags={"sonar.eval.checkpoint": str(model_dir)},
                              parent_of=model_dir)
    log.info("sonar eval: writing predictions and the table to %s; MLflow run %r in %s", out, run_name,
             getattr(sink, "uri", "(tracking off)"))
    table: dict[str, dict] = {}
    current = None
    try:
        sink.log_params({**flatten(to_dict(cfg)), "eval.checkpoint": str(model_dir), "eval.step": step,
                         "eval.searched": where,
                         "eval.config": source or "the config given",
                         **{f"eval.data.{name}": str(path) for name, path, _ in datasets}})
        for name, path, items in datasets:
            current = (name, path)
            prompts = [PromptItem(prompt_id=it.qid, question=it.question, golds=list(it.golds), meta=dict(it.meta))
                       for it in items]
            with tqdm(total=len(prompts), desc=f"eval {name}", unit="q") as bar:
                records = asyncio.run(evaluation.greedy_records(
                    prompts, engine=engine, retriever=retriever, tokenizer=tokenizer, tags=tags, proto=cfg.protocol,
                    k=cfg.retrieval.k, reward=cfg.stages[-1].reward, batch_size=cfg.eval.batch_size,
                    progress=bar.update, tools=build_tools(cfg)))
            pred = out / f"predictions-{name}.jsonl"
            tmp = pred.with_suffix(".jsonl.tmp")
            with open(tmp, "w") as fh:
                for r in records:
                    fh.write(json.dumps(r) + "\n")
            tmp.replace(pred)  # a predictions file is whole or absent
            table[name] = evaluation.summarize(records)
            (out / "eval.md").write_text(evaluation.markdown(table))  # the rows finished so far
            sink.log_metrics(evaluation.eval_metrics(name, table[name]), step=step)
            (out / "eval_summary.json").write_text(json.dumps(table, indent=2, default=str))
            sink.log_artifact(str(pred), "predictions")
            sink.log_artifact(str(out / "eval.md"))
            sink.log_artifact(str(out / "eval_summary.json"))
            current = None
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        try:
            sink.finish("KILLED" if interrupted else "FAILED")
        except BaseException:  # noqa: BLE001 - the original error is the one to report
            log.exception("could not mark the MLflow run")
        if interrupted or not isinstance(e, Exception):
            raise
        (out / "error.log").write_text("".join(traceback.format_exception(e)))
        where = f"dataset {current[0]} ({current[1]})" if current else "logging"
        kept = f"{len(table)} finished dataset(s) kept in {out}" if table else f"no dataset finished; output in {out}"
        raise EvalFailed(f"evaluation failed on {where}: {_one_line(e)}; {kept}; MLflow run {sink.run_id} "
                         f"marked FAILED; traceback in {out / 'error.log'}", table) from e
    sink.finish("FINISHED")
    print("\n" + evaluation.markdown(table) + f"\nsonar eval: searching {where}\n"
          f"predictions and table in {out} (MLflow run {sink.run_id})\n", flush=True)
    return table
