"""`sonar --version`, `sonar config show|validate|list`, one override syntax (in-process: no Ray, no run)."""
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from sonar.cluster.driver.cli import main
from sonar.cluster.wire.paths import presets


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    import sonar

    # the imported package's version and folder (under a job from a checkout: the checkout's, not the
    # installed distribution's); it is the distribution's version when they are one copy
    assert sonar.__version__ == version("sonar-rl")
    assert capsys.readouterr().out.strip() == f"sonar {sonar.__version__} from {Path(sonar.__file__).resolve().parent}"


def test_config_show_prints_the_resolved_yaml_with_overrides(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SONAR_RUN_ROOT", raising=False)
    assert main(["config", "show", "--config", "smoke", "run.name=shown", "rollout.num_workers=3"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["run"]["name"] == "shown" and shown["rollout"]["num_workers"] == 3
    assert shown["run"]["root"] == str(tmp_path / "runs")  # made explicit
    assert shown["world"]["num_entities"] == yaml.safe_load(presets()["smoke"].read_text())["world"]["num_entities"]
    assert not (tmp_path / "runs").exists()  # nothing written


def test_config_validate_exits_0_or_2_with_the_field(capsys):
    assert main(["config", "validate", "--config", "smoke"]) == 0
    assert "config ok" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["config", "validate", "--config", "smoke", "run.log_every=0"])
    assert e.value.code == 2
    assert "run.log_every=0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["config", "validate", "--config", "no-such-preset"])
    assert e.value.code == 2 and "not a preset name" in capsys.readouterr().err


def test_config_list_names_every_preset_with_its_first_comment(capsys):
    assert main(["config", "list"]) == 0
    lines = capsys.readouterr().out.split("\n\nplug-in fields")[0].splitlines()  # then the plug-in fields
    assert [ln.split()[0] for ln in lines] == list(presets())
    assert any(ln.startswith("tiny") and "the embedded default" in ln for ln in lines)


def test_config_fields_prints_each_field_with_its_range_and_whole_description(capsys):
    from sonar.cluster.wire.config import describe_fields

    assert main(["config", "fields", "run.log_every", "stages.N.algo.clip_low"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run.log_every: int = 1  (>= 1)\n    SFT stages: send the learner's metrics")
    assert "always logged (the run summary reads every one)." in " ".join(out.split())  # its last words: all of it
    assert "stages.N.algo.clip_low: float = 0.2  ([0, 1))\n" in out
    assert main(["config", "fields"]) == 0
    heads = {ln.split(":")[0]: ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith(" ")}
    ranges = {key: rng for key, _, _, rng, _ in describe_fields() if rng is not None}
    assert len(ranges) > 80 and "learner.betas" in ranges
    for key, rng in ranges.items():  # every range as declared, on its field's line
        assert heads[key].endswith(f"  ({rng})"), heads[key]
    assert "model.path" in heads and "(" not in heads["model.path"].split("=")[1]  # no range, none printed
    assert main(["config", "fields", "no_such_section"]) == 2
    assert "no config field is or starts with no_such_section" in capsys.readouterr().err


def test_bench_takes_bare_overrides_and_set_as_a_deprecated_alias(monkeypatch, capsys):
    import sonar.bench.common as common

    monkeypatch.setattr(common, "check_provenance", lambda: None)
    p = common.driver_bench_parser("x", "d", "c")
    ns = p.parse_args(["a.b=1", "--quick", "c.d=2", "--set", "e.f=3"])
    assert ns.quick and ns.overrides == ["e.f=3", "a.b=1", "c.d=2"]
    assert "deprecated" in capsys.readouterr().err
    assert p.parse_args([]).overrides == []


def _undocumented(p, path):
    """(command, option) for every option or positional of parser ``p`` and its subcommands without help."""
    import argparse

    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _undocumented(sub, path + [name])
        elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)) and not (a.help or "").strip():
            yield " ".join(path), a.dest


class _Parsed(Exception):
    """Raised instead of parsing: carries the parser a benchmark's ``main`` built."""


def _bench_parser(name: str, monkeypatch):
    """The parser ``sonar bench NAME`` builds (each benchmark builds its own inside ``main``): caught at
    its first ``parse_args``, before anything runs."""
    import argparse
    import importlib

    from sonar.bench.run import find_module

    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_intermixed_args", caught)
    with pytest.raises(_Parsed) as e:
        importlib.import_module(find_module(name)).main([])
    monkeypatch.undo()
    return e.value.args[0]


def test_every_option_of_every_verb_has_help_text(monkeypatch):
    """`sonar <verb> --help` explains every option and positional: the verbs of ``cli.build_parser`` and
    the three that parse their own arguments (score, chaos, and each ``sonar bench NAME``)."""
    from sonar.actors.scoring import build_parser as score_parser
    from sonar.bench.run import available
    from sonar.cluster.driver.chaos import build_parser as chaos_parser
    from sonar.cluster.driver.cli import build_parser

    parsers = {"sonar": build_parser(), "sonar score": score_parser(), "sonar chaos": chaos_parser()}
    names = available()
    assert "learner" in names and "end-to-end" in names  # the benchmarks were found
    parsers.update({f"sonar bench {n}": _bench_parser(n, monkeypatch) for n in names})
    assert {p.prog for k, p in parsers.items() if k.startswith("sonar bench ")} == {f"sonar bench {n}" for n in names}
    missing = [m for prog, p in parsers.items() for m in _undocumented(p, [prog])]
    assert missing == []


def test_the_help_walk_sees_an_option_without_help():
    import argparse

    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--a", help="documented")
    p.add_argument("--b")
    sub = p.add_subparsers(dest="cmd", help="verbs")
    sub.add_parser("v").add_argument("c", help=" ")
    assert list(_undocumented(p, ["x"])) == [("x", "b"), ("x v", "c")]


def test_worker_lines_carry_no_colour_codes_when_the_output_is_not_a_terminal(monkeypatch):
    """Ray prefixes its workers' lines with ANSI colours unless RAY_COLOR_PREFIX=0 (ray/_private/worker.py,
    print_worker_logs): set when stderr is a file or a pipe, left alone on a terminal or when the user set it."""
    import io
    import os

    from sonar.cluster.driver import cli

    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    monkeypatch.setattr(cli.sys, "stderr", io.StringIO())
    cli._env_defaults()
    assert os.environ["RAY_COLOR_PREFIX"] == "0"
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    tty = io.StringIO()
    tty.isatty = lambda: True
    monkeypatch.setattr(cli.sys, "stderr", tty)
    cli._env_defaults()
    assert "RAY_COLOR_PREFIX" not in os.environ
