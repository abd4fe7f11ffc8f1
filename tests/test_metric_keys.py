"""Metric names come from ``sonar.cluster.wire.metrics`` only.

Production code (actors, learner, retrieval, cluster) must not spell a metric key as a string: every
string literal (f-strings included) that starts with a metric namespace is refused outside the
constants module. The benchmarks read Sonar's metric history too: a literal there that *is* one of
Sonar's keys is refused as well (their own result names, e.g. ``replay/put_one`` timings, are theirs).
Every constant in the module is used somewhere, so a renamed key cannot leave a stale twin behind.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import sonar.cluster.wire.metrics as K

ROOT = Path(K.__file__).resolve().parents[2]
METRICS = Path(K.__file__).resolve()
PRODUCTION = ("actors", "learner", "retrieval", "cluster")
NAMESPACE = re.compile(r"^(rollout|learner|replay|retrieval|weights|eval)/")
CONSTANTS = {name: value for name, value in vars(K).items() if name.isupper() and isinstance(value, str)}


def _files(pkgs) -> list[Path]:
    return sorted(p for pkg in pkgs for p in (ROOT / pkg).rglob("*.py") if p.resolve() != METRICS)


def _literals(tree: ast.AST):
    """(line, text) of every string constant, and of the leading literal part of every f-string."""
    in_fstring: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for v in node.values:
                in_fstring.add(id(v))
            if node.values and isinstance(node.values[0], ast.Constant) and isinstance(node.values[0].value, str):
                yield node.lineno, node.values[0].value + "{}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring:
            yield node.lineno, node.value


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"\{[a-z_]*\}", template)
    return re.compile("[A-Za-z0-9_]*".join(re.escape(p) for p in parts))  # a part, never a file name


KEY_PATTERNS = [_template_regex(v) for v in CONSTANTS.values()]


def test_the_constants_module_defines_keys():
    assert len(CONSTANTS) > 30 and all(NAMESPACE.match(v) for v in CONSTANTS.values())
    dup = {v for v in CONSTANTS.values() if list(CONSTANTS.values()).count(v) > 1}
    assert not dup, f"two constants for one key: {dup}"


def test_production_code_spells_no_metric_key():
    found = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in _files(PRODUCTION)
             for line, text in _literals(ast.parse(p.read_text())) if NAMESPACE.match(text)]
    assert not found, "metric keys written as literals (use sonar.cluster.wire.metrics):\n" + "\n".join(found)


def test_benchmarks_read_sonar_metrics_through_the_constants():
    found = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in _files(["bench"])
             for line, text in _literals(ast.parse(p.read_text()))
             if any(rx.fullmatch(text.replace("{}", "x")) for rx in KEY_PATTERNS)]
    assert not found, "Sonar metric keys written as literals (use sonar.cluster.wire.metrics):\n" + "\n".join(found)


def test_every_constant_is_used():
    used: set[str] = set()
    for p in _files(PRODUCTION + ("bench",)):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in CONSTANTS:
                used.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and node.module == "sonar.cluster.wire.metrics":
                used |= {a.name for a in node.names}
    assert not set(CONSTANTS) - used, f"metric constants nobody uses: {sorted(set(CONSTANTS) - used)}"


@pytest.mark.parametrize("src, flagged", [
    ('m = {"learner/loss": 1.0}', True),
    ('m[f"learner/policy_lag/hist/{k}"] = 1', True),
    ('path = "learner.lr"', False),
    ('m[K.LEARNER_LOSS] = 1', False),
])
def test_the_literal_scan_sees_keys(src, flagged):
    assert any(NAMESPACE.match(t) for _, t in _literals(ast.parse(src))) == flagged


@pytest.mark.parametrize("text, is_key", [
    ("learner/loss", True), ("learner/policy_lag/hist/x", True), ("retrieval/errors/timeout", True),
    ("eval/after_search/em", True), ("learner/train_step.py", False), ("replay/put_one", False),
])
def test_the_bench_scan_knows_sonar_keys(text, is_key):
    assert any(rx.fullmatch(text) for rx in KEY_PATTERNS) == is_key
