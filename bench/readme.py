"""``sonar bench readme``: every results table of README.md, cluster/README.md and bench/README.md, rendered from the JSON it names.

Question (issue 24: the READMEs' results tables are regenerated from the JSONs by a script, so they cannot
drift): none; this runs nothing. A results block in a document opens with
``<!-- KIND table: bench/results/X.json[, bench/results/Y.json ...] (...) -->`` and closes with
``<!-- /KIND table -->``; KIND is a benchmark's name, then a word naming the table where the benchmark has
several (``weight-sync times``). ``BLOCKS`` maps each KIND to the function of that benchmark's module that
renders it from the result(s) the opening marker names: ``render(doc, json_name)``, or for a table drawn from
several results (``MANY``) ``render([(json_name, doc), ...])``; each returns the block, markers included.

``sonar bench readme`` re-renders every block of both documents from the JSON its marker names (and
README.md's default-run time phrase beside its table); ``--check`` changes nothing and exits 1 naming each
block that differs. A block shows a full result written from a clean tree (``common.load_full_result``), the
one its marker names; to show another, edit the path in the marker (or run the benchmark's own ``--readme
JSON`` where it has one: default-run, async-vs-sync) and render again. ``tests/bench/test_readme_blocks.py``
keeps every block equal to its rendering.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from sonar.bench import (async_vs_sync, codec_and_queue, corpus_scale, default_run, end_to_end, engines, learner_bench,
                         lora, multi_query, retrieval_bench, rollout_scaling, schedule_sim, sensitivity, soak,
                         weight_sync)
from sonar.bench.common import READMES, REPO_ROOT, load_full_result, splice

BLOCKS = {
    "default-run": default_run.render_table,
    "default-run placements": default_run.render_placements_table,
    "learner": learner_bench.render_table,
    "async-vs-sync": async_vs_sync.render_table,
    "async-vs-sync variant": async_vs_sync.render_variant_table,
    "async-vs-sync lags": async_vs_sync.render_lags_table,
    "async-vs-sync ablation": async_vs_sync.render_ablation_table,
    "sensitivity": sensitivity.render_table,
    "weight-sync times": weight_sync.render_times_table,
    "weight-sync ratios": weight_sync.render_ratios_table,
    "codec-and-queue codec": codec_and_queue.render_codec_table,
    "codec-and-queue queues": codec_and_queue.render_queue_table,
    "retrieval": retrieval_bench.render_table,
    "corpus-scale": corpus_scale.render_table,
    "multi-query": multi_query.render_table,
    "multi-query saving": multi_query.render_saving_table,
    "rollout-scaling": rollout_scaling.render_table,
    "end-to-end": end_to_end.render_table,
    "engines": engines.render_table,
    "soak": soak.render_table,
    "schedule-sim": schedule_sim.render_table,
    "lora": lora.render_table,
}
"""Block kind -> the function that renders it (the kind's first word is the benchmark that wrote the JSON)."""
MANY = {"async-vs-sync ablation", "default-run placements"}
"""The kinds rendered from several results at once."""
MARKER = re.compile(r"<!-- ([a-z0-9-]+(?: [a-z0-9-]+)?) table: "
                    r"(bench/results/\S+?\.json(?:, bench/results/\S+?\.json)*)[ -]")
"""An opening marker: the kind, then the comma-separated results it names."""


def blocks(text: str) -> list[tuple[str, list[str]]]:
    """(kind, [result path under bench/results, ...]) of every results block in ``text``, in order."""
    return [(m.group(1), [p.removeprefix("bench/results/") for p in m.group(2).split(", ")])
            for m in MARKER.finditer(text)]


def render_block(kind: str, names: list[str], root: Path = REPO_ROOT) -> str:
    """The block of ``kind`` rendered from the results ``names`` (paths under ``root``/bench/results), each
    loaded as a full clean result of the kind's benchmark (ValueError otherwise, or for an unknown kind)."""
    if kind not in BLOCKS:
        raise ValueError(f"a results block of unknown kind {kind!r}: known {sorted(BLOCKS)}")
    bench = kind.split()[0]
    docs = [load_full_result(root / "bench" / "results" / n, bench) for n in names]
    if kind in MANY:
        return BLOCKS[kind](list(zip(names, docs)))
    if len(names) != 1:
        raise ValueError(f"a {kind} block names {len(names)} results; it is rendered from one")
    return BLOCKS[kind](docs[0], names[0])


def render_document(text: str, root: Path = REPO_ROOT) -> str:
    """``text`` with every results block re-rendered from the results its marker names; README.md's
    default-run run-time phrase with its table."""
    for kind, names in blocks(text):
        begin = f"<!-- {kind} table: " + ", ".join(f"bench/results/{n}" for n in names)
        text = splice(text, begin, f"<!-- /{kind} table -->", render_block(kind, names, root), f"{kind} table")
        if kind == "default-run":
            doc = json.loads((root / "bench" / "results" / names[0]).read_text())
            text = splice(text, default_run.TIME_BEGIN, default_run.TIME_END, default_run.render_time(doc),
                          "default-run time")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sonar bench readme", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="write nothing: exit 1 naming each block that differs from its rendering")
    p.add_argument("--root", default=str(REPO_ROOT),
                   help="the checkout whose README.md, bench/README.md and bench/results are used (default: this one)")
    args = p.parse_args(argv)
    root, stale = Path(args.root), []
    for name in READMES:
        path = root / name
        text = path.read_text()
        new = render_document(text, root)
        kinds = [k for k, _ in blocks(text)]
        if new == text:
            print(f"[readme] {name}: {len(kinds)} results block(s), each equal to its JSON")
            continue
        changed = [k for k, ns in blocks(text) if render_block(k, ns, root) not in text]
        stale.append(f"{name}: {', '.join(changed) or 'default-run time'}")
        if not args.check:
            path.write_text(new)
            print(f"[readme] {name}: re-rendered {', '.join(changed) or 'default-run time'} from their JSON")
    if args.check and stale:
        print("[readme] differs from its JSON: " + "; ".join(stale) + " (`sonar bench readme` renders them)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
