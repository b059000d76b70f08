"""The documentation stays true: every `meshtrain` command in the README and the guide parses
and every `train` command passes the CLI's settings checks as written (the run itself is not
started here); every link points at a file inside the repository."""

import re
import shlex
from pathlib import Path

import pytest

from meshtrain.cli.main import _train_config
from meshtrain.cli.parsers import build_parser
from meshtrain.config import run_config as config

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(path: Path) -> list[tuple[list[str], int]]:
    """(meshtrain argv, world size) of each command line: continuation lines joined, comments
    dropped; torchrun lines give their world (nodes x processes per node)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    found = []
    for line in text.splitlines():
        line = line.split(" # ")[0].split("  #")[0].strip()
        if not line.startswith(("meshtrain ", "torchrun ")):
            continue
        words = shlex.split(line)
        world = None
        if words[0] == "torchrun" and "-m" in words and words[words.index("-m") + 1] == "meshtrain":
            options = dict(zip(words[1::2], words[2::2], strict=False))
            world = int(options.get("--nnodes", 1)) * int(options.get("--nproc-per-node", 1))
            words = words[words.index("-m") + 1:]
        if words[0] == "meshtrain" and len(words) > 1 and not words[1].startswith("-"):
            found.append((words[1:], world))
    return found


COMMANDS = [(path.name, argv, world) for path in DOCS for argv, world in _commands(path)]


def test_the_docs_show_commands():
    names = {argv[0] for _, argv, _ in COMMANDS}
    assert {"train", "export", "sample"} <= names and len(COMMANDS) > 30


@pytest.mark.parametrize("doc,argv,world", COMMANDS,
                         ids=[f"{d}:{' '.join(a)[:60]}" for d, a, _ in COMMANDS])
def test_documented_command_is_valid(doc, argv, world, tmp_path):
    if argv == ["train", "--help"]:
        return
    args = build_parser().parse_args(argv)
    if args.command != "train" or "--config" in argv or "--init-from" in argv:
        return  # (the TOML example writes its file, --init-from reads a run made before it)
    cfg = _train_config(args)
    config.validate(cfg, config.world_size_of(cfg, world))


def test_links_stay_inside_the_repository():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
            if target.startswith("http"):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_file() and ROOT.resolve() in resolved.parents, (path, target)
        assert "../shared" not in path.read_text(), path
