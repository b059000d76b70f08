"""`--help` of every subcommand: train's flags grouped as the TOML tables, one default each, the
choices listed, no flag named that the subcommand lacks; a bad flag prints the usage of the
subcommand it was given to."""

import argparse
import re

import pytest

from meshtrain.cli.main import main
from meshtrain.cli.parsers import build_parser, help_group
from meshtrain.config.run_config import flag_fields

COMMANDS = [["train"], ["plan"], ["plan", "calibrate"], ["plan", "validate"], ["export"],
            ["import-hf"], ["sample"], ["doctor"], ["prepare"], ["tokenizer", "train"]]


@pytest.fixture(autouse=True)
def _unwrapped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # flags are not cut at a line's end


def _help(capsys, command: list[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _parser(command: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _options(text: str) -> dict[str, str]:
    """Each option's help entry (its flag line and the indented lines after it)."""
    entries = re.split(r"\n +(?=-)", text)
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries[1:]}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_names_only_its_own_flags_and_states_each_default_once(capsys, command):
    text = _help(capsys, command)
    own = {flag for action in _parser(command)._actions for flag in action.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
    assert named <= own, f"{' '.join(command)} --help names {sorted(named - own)}"
    entries = _options(text)
    for entry in entries.values():
        assert entry.count("(default") <= 1, entry
    for action in _parser(command)._actions:  # a value a flag takes unless given is stated
        if action.option_strings and action.default not in (None, False, "", argparse.SUPPRESS):
            assert "default" in entries[action.option_strings[-1]], action.option_strings


def test_train_help_groups_every_flag_as_the_toml_tables(capsys):
    text = _help(capsys, ["train"])
    headings = re.findall(r"^(\w[\w ]*):\n  (.*)$", text, re.M)
    groups = {title: line for title, line in headings if title not in ("usage", "options")}
    assert list(groups) == ["model", "data", "parallel layout", "precision", "training",
                            "optimizer", "checkpoints", "logging", "operations"]
    sections = [text.index(f"\n{title}:\n") for title in groups]
    for section, f in flag_fields():
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        where = re.search(rf"\n  {re.escape(flag)}[ \n]", text).start()
        group = help_group(section, f.name)
        start = sections[list(groups).index(group)]
        assert start < where and not any(start < s < where for s in sections), flag
        assert f"[{section}]" in groups[group] or f"[{section}]" in text[start:where], flag
        if f.metadata.get("choices"):
            entry = _options(text)[flag]
            assert "{" + ",".join(map(str, f.metadata["choices"])) + "}" in entry.replace(
                " ", ""), entry


@pytest.mark.parametrize("command", [["train"], ["sample", "RUN"], ["plan", "calibrate",
                                                                       "--out", "x.toml"]],
                         ids=lambda c: c[0] if len(c) < 3 else "plan calibrate")
def test_an_unknown_flag_prints_the_subcommands_usage(capsys, command):
    with pytest.raises(SystemExit) as done:
        main([*command, "--no-such-flag"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    name = " ".join(w for w in command if w.islower() and w not in ("--out", "x.toml"))
    assert err.startswith(f"usage: meshtrain {name} "), err
    assert f"meshtrain {name}: error: unrecognized arguments: --no-such-flag" in err
