"""Every command and path README.md (and each room's README it links) names is real (issue 25: documents that match the code, kept so).

- each ``sonar ...`` / ``python -m sonar ...`` command, in a code block or an inline code span, names a
  verb that exists (``sonar config <what>``, ``sonar bench <NAME>`` included) and only options that
  verb's parser accepts; ``sonar VERB --help`` exits 0 for every verb named;
- each ``make TARGET`` is a Makefile target;
- each repository path in an inline code span (``cluster/driver/files.py``, ``configs/smoke.yaml``, ...)
  exists.

No Ray, no runs: the parsers are the CLI's own (the benchmarks' are caught at their first parse, as
``tests/cluster/test_cli_verbs.py`` does).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.cluster.test_cli_verbs import _bench_parser

ROOT = Path(__file__).resolve().parents[1]
from sonar.bench.common import DOCS  # noqa: E402  (the top-level README and each room's own)

README = "\n\n".join((ROOT / d).read_text() for d in DOCS)
TOP_FOLDERS = ("actors", "learner", "retrieval", "cluster", "configs", "tests", "bench", ".ci")


START = r"(sonar|python3? -m \S+|python3? \S+\.py|make) "
"""What a command line starts with: the CLI, a module or script run by python, or make."""


def _commands(text: str) -> list[str]:
    """The command lines: lines of fenced code blocks (continuations joined, comments cut) and inline
    code spans that start with ``sonar``, ``python -m MODULE``, ``python SCRIPT.py`` or ``make``."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if re.match(START, line + " "):
                out.append(line)
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(START, span + " "):
            out.append(span.strip())
    return out


COMMANDS = _commands(README)


def _verbs(cmd: str) -> list[tuple[str, ...]]:
    """``sonar config show|validate --config x`` -> [("config", "show"), ("config", "validate")]."""
    words = re.sub(r"^python3? -m ", "", cmd).split()[1:]
    if not words or words[0].startswith("-"):
        return [()]
    head = words[0]
    if head in ("config", "bench") and len(words) > 1 and not words[1].startswith(("-", "[")):
        return [(head, sub) for sub in words[1].split("|")]
    return [(head,)]


@pytest.fixture(scope="module")
def parsers(request):
    from sonar.actors.scoring import build_parser as score_parser
    from sonar.cluster.driver.chaos import build_parser as chaos_parser
    from sonar.cluster.driver.cli import build_parser

    root = build_parser()
    sub = root._subparsers._group_actions[0].choices
    config = sub["config"]._subparsers._group_actions[0].choices
    found = {(): root, ("score",): score_parser(), ("chaos",): chaos_parser()}
    found.update({(v,): p for v, p in sub.items() if v not in ("score", "chaos", "bench", "config")})
    found.update({("config", v): p for v, p in config.items()})
    mp = pytest.MonkeyPatch()
    try:
        from sonar.bench.run import available

        found.update({("bench", n): _bench_parser(n, mp) for n in available()})
    finally:
        mp.undo()
    return found


def test_the_readme_has_commands_to_check():
    assert len(COMMANDS) > 30 and "make run" in COMMANDS and "make test" in COMMANDS
    assert any(c.startswith("sonar bench ") for c in COMMANDS) and any(c.startswith("sonar config ") for c in COMMANDS)


SONAR = [c for c in COMMANDS if re.match(r"(sonar|python3? -m sonar) ", c + " ")]


def runnable(module: str) -> bool:
    """``python -m module`` runs something: a module, or a package with a ``__main__`` (from the
    repository root, where the README's commands run: its folders are importable there too)."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    return not spec.submodule_search_locations or importlib.util.find_spec(module + ".__main__") is not None


def test_each_python_command_runs_a_real_module_or_script():
    bad = []
    for c in COMMANDS:
        m = re.match(r"python3? (-m (\S+)|(\S+\.py))", c)
        if m and m.group(2) and not runnable(m.group(2)):
            bad.append(f"`{c}`: `python -m {m.group(2)}` has nothing to run")
        elif m and m.group(3) and not (ROOT / m.group(3)).is_file():
            bad.append(f"`{c}`: no file {m.group(3)}")
    assert not bad, f"README.md: {bad}"


@pytest.mark.parametrize("cmd", SONAR)
def test_each_sonar_command_names_a_real_verb_and_real_options(cmd, parsers):
    for verb in _verbs(cmd):
        assert verb in parsers, f"README.md: `{cmd}` names `sonar {' '.join(verb)}`, which does not exist"
        accepted = set(parsers[verb]._option_string_actions)
        options = {re.sub(r"[=\])|,.;:].*$", "", w.lstrip("[")) for w in cmd.split() if w.lstrip("[").startswith("--")}
        unknown = sorted(o for o in options if o not in accepted)
        assert not unknown, f"README.md: `{cmd}`: `sonar {' '.join(verb)}` has no option {unknown}"


@pytest.mark.parametrize("verb", sorted({v for c in SONAR for v in _verbs(c) if v}))
def test_each_named_verb_prints_its_help(verb, capsys):
    from sonar.cluster.driver.cli import main

    with pytest.raises(SystemExit) as e:
        main([*verb, "--help"])
    assert e.value.code in (0, None), f"`sonar {' '.join(verb)} --help` exited {e.value.code}"
    assert "usage:" in capsys.readouterr().out


def test_each_make_target_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-zA-Z][\w-]*):", makefile, re.M))
    named = {c.split()[1] for c in COMMANDS if c.startswith("make ")}
    assert named and not named - targets, f"README.md names make targets the Makefile lacks: {named - targets}"


def test_each_repository_path_exists():
    spans = re.findall(r"`([^`\s]+)`", README)
    paths = {s.rstrip(".,:;") for s in spans if s.split("/", 1)[0] in TOP_FOLDERS and "/" in s
             and not re.search(r"[<>*{}$]|\.\.\.", s)}
    # and the files the diagrams and command blocks name (`driver (cluster/driver/loop.py)`)
    for block in re.findall(r"```[a-z]*\n(.*?)```", README, re.S):
        paths |= set(re.findall(r"(?<![\w/.$<-])((?:%s)/[\w./-]*\w\.[a-z]+)" % "|".join(TOP_FOLDERS[:-1]), block))
    paths = {p.split(":", 1)[0] for p in paths}  # `cluster/driver/files.py:check` -> the file
    # a file (an extension) or a folder (a trailing slash); `retrieval/replicas_replaced` is a metric name
    paths = {p for p in paths if p.endswith("/") or "." in p.rsplit("/", 1)[-1]}
    assert len(paths) > 20
    # what `make test` writes (CI keeps them): named in the Makefile, not in the tree
    makefile = (ROOT / "Makefile").read_text()
    written = {p for p in paths if p.startswith(".ci/") and p in makefile}
    missing = sorted(p for p in paths - written if not (ROOT / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_the_extraction_sees_blocks_spans_and_alternatives():
    text = "```bash\nsonar train --config x \\\n  a=1   # note\nmake run\n```\nsee `sonar config show|validate --config y`."
    assert _commands(text) == ["sonar train --config x    a=1", "make run", "sonar config show|validate --config y"]
    assert _verbs("sonar config show|validate --config y") == [("config", "show"), ("config", "validate")]
    assert _verbs("python -m sonar train ...") == [("train",)] and _verbs("sonar --version") == [()]
    # the drift issue 25 found: `python -m cluster train` is seen, and `cluster` runs nothing
    assert _commands("run `python -m cluster train` or `python bench/gpu_check.py --out x`") == [
        "python -m cluster train", "python bench/gpu_check.py --out x"]
    assert not runnable("cluster") and runnable("sonar") and runnable("json.tool")


def test_the_readme_stays_short_and_links_every_rooms_readme():
    """The top-level README teaches in under 3,000 words and points to each room's README for the detail."""
    top = (ROOT / "README.md").read_text()
    assert len(top.split()) < 3000, f"README.md has {len(top.split())} words: move detail to a room's README"
    for doc in [*DOCS[1:], "bench/README.md"]:
        assert f"]({doc})" in top, f"README.md does not link {doc}"


def test_the_readme_teaches_in_3000_words_with_no_commit_hash_in_its_prose_and_links_every_room():
    """Issue 55: the README is a short tour (at most 3,000 words), its prose names no commit (hashes live
    in generated blocks and result files only), and it links every room's own README."""
    import re

    from tests.checkout import ROOT

    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 3000, f"README.md has {len(text.split())} words (budget 3,000)"
    prose = re.sub(r"<!-- (?P<name>[^:>]+?)(?::[^>]*)? -->.*?<!-- /(?P=name) -->", "", text, flags=re.S)
    prose = re.sub(r"```.*?```", "", prose, flags=re.S)  # commands
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", prose) if re.search(r"\d", h) and re.search(r"[a-f]", h)]
    assert not hashes, f"README.md prose names commits: {hashes}"
    for room in ("actors", "learner", "retrieval", "cluster", "bench"):
        assert (ROOT / room / "README.md").is_file() and f"({room}/README.md)" in text, room
