"""The documentation stays true. Every `meshtrain` command in the README and the docs parses and
every `train` command passes the CLI's settings checks as written; every link points at a file
inside the repository; and the commands run: the README's command blocks (default suite) and the
user guide's (`-m extended`, minutes) are executed in order, each document in a fresh directory
holding copies of README.md, docs/ and examples/, as a reader pastes them into a shell (bash; the
commands `meshtrain`, `python`, `python3` and `torchrun` are this interpreter's; one thread per
process, OMP_NUM_THREADS=1; gloo ranks). Each command has a timeout and its time is printed
(`-s` shows the table).

What runs and what is only parsed; the markers are comments a reader sees in the document:

- A code block is an indented one (4 spaces past the paragraph or list item it belongs to) or a
  fenced one. A shell block is a sequence of commands: a line, with its `\\` continuation lines
  and any here-document up to its end marker. Lines holding only a comment are not commands.
- `# needs ...` (`# needs 8 ranks`, `# needs a GPU`, `# needs 2 nodes`, `# needs a Gemma
  model directory`): what this host (CPU, at most 4 ranks, tiny presets) or the fresh directory
  does not have. As a command's comment it marks that command, as a block's first line the whole
  block: parsed, not run. A command this test would run with more than 4 ranks, on a GPU or with
  a `HOST` placeholder fails the test until it is marked.
- `# or ...` as a command's comment: an alternative to the command before it; the first of a run
  of alternatives runs, the others are parsed only.
- `# example output ...` as a block's first line: the block shows what a command printed where
  this test cannot reproduce it (a run stopped by a signal from another shell, a hang, a NaN,
  losses that vary with the Python version); nothing in it runs.
- `# excerpt ...` as a block's first line: part of a file (the Python API), not a program.
- Setup is recognized, not marked: `python3 -m venv`, `. .venv/bin/activate`, `pip install` and
  `python -m pytest` (this suite) are skipped, and the rest of an `&&` chain runs: the test uses
  the environment it runs in.
- A block with `$ ` prompts is a session: each `$` line is a command and the lines after it are
  what it prints. Every shown line must appear, in order, in its output (`...` stands for any
  text); a shown `meshtrain: error:` line means exit code 2, otherwise 0.
- Every other command must exit 0. An environment prefix (`WANDB_MODE=offline meshtrain ...`)
  is the shell's. An unmarked fenced ```python block runs with `python -c`.

A later command never writes where an earlier one did unless it resumes that run (checked for
both documents in the default suite: `test_outputs_do_not_collide`), and what the commands write
is ignored by git. The README runs without the guide's outputs, so a README command reading
what only the guide makes fails unless it is marked `# needs ...`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshtrain.cli.main import _train_config
from meshtrain.cli.parsers import build_parser
from meshtrain.config import run_config as config
from meshtrain.operations.replica_launch import group_world
from meshtrain.parallel.runtime.capabilities import table

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README, GUIDE = ROOT / "README.md", ROOT / "docs" / "guide.md"


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
    ranks = group_world(cfg, config.world_size_of(cfg, world), under_torchrun=world is not None)
    config.validate(cfg, ranks)


def test_the_compatibility_table_is_the_declarations():
    """The guide's table of what combines with what is generated from the capabilities."""
    assert "\n".join(table()) in GUIDE.read_text()


def _fault_rows() -> list[list[str]]:
    """The cells of each row of the guide's table of faults injected in the tests."""
    text = GUIDE.read_text()
    section = text[text.index("### Faults injected in the tests"):]
    section = section[:section.index("\n#", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def test_every_fault_row_names_tests_that_exist():
    """Each row of the guide's fault table names at least one test (file::function) and a
    count of at least 1, and each test named is defined in that file: a renamed or deleted test
    fails here rather than leaving a claim no test backs."""
    rows = _fault_rows()
    assert len(rows) > 30
    for fault, count, backing, *_ in rows:
        named = re.findall(r"(test_\w+\.py)::(test_\w+)", backing)
        assert named and int(count) >= 1, f"no test backs the fault row {fault!r}"
        for file, function in named:
            source = ROOT / "tests" / file
            assert source.is_file() and re.search(rf"^def {function}\(", source.read_text(),
                                                   re.M), f"{file}::{function} ({fault!r})"


def test_links_stay_inside_the_repository():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
            if target.startswith("http"):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_file() and ROOT.resolve() in resolved.parents, (path, target)
        assert "../shared" not in path.read_text(), path


SOURCE_NAMED_IN = [README, GUIDE, ROOT / "docs" / "design.md"]
PYTHON_FILES = sorted(path.relative_to(ROOT).as_posix() for folder in
                      ("src", "tests", "examples", "benchmarks") for path in
                      (ROOT / folder).rglob("*.py"))


def test_the_source_the_docs_name_is_the_codes():
    """Every Python file the README, the guide and the design name (`parallel/runtime/plan.py`,
    a path from the repository's root or the tail of one) is a file of the repository, and every
    dotted `meshtrain.x.y` (a module, then attributes) imports; a file name such as
    `meshtrain.json` is no module."""
    missing = []
    for doc in SOURCE_NAMED_IN:
        text = doc.read_text()
        for match in re.finditer(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b", text):
            path = match.group(1)
            if not any(f == path or f.endswith("/" + path) for f in PYTHON_FILES):
                missing.append(f"{doc.name}:{text[:match.start()].count(chr(10)) + 1} {path}")
        for match in re.finditer(r"(?<![\w/.-])meshtrain(?:\.[A-Za-z_]\w*)+", text):
            parts = match.group(0).split(".")
            if parts[-1] in ("json", "toml", "py", "bin", "safetensors"):
                continue
            if _imported(parts) is None:
                missing.append(f"{doc.name}:{text[:match.start()].count(chr(10)) + 1}"
                               f" {match.group(0)}")
    assert not missing, missing


def _imported(parts: list[str]):
    """What the dotted name `parts` imports as (its longest module, then attributes), or None."""
    import importlib

    for i in range(len(parts), 0, -1):
        try:
            thing = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            thing = getattr(thing, name, None)
        return thing
    return None


def test_the_guides_plan_output_is_the_codes(capsys):
    """The guide's `meshtrain plan` sessions (pure computation, a second each) print what the
    guide shows, in the default suite: the planner's numbers change with its cost model."""
    from meshtrain.cli.main import main

    sessions = [c for c in _doc_commands(GUIDE) if c.shown and not c.skip
                and (_meshtrain_argv(_words(c)) or [""])[0] == "plan"
                and "calibrate" not in _words(c)]
    assert len(sessions) >= 3
    for command in sessions:
        capsys.readouterr()
        assert main(_meshtrain_argv(_words(command))) == 0, command.text
        output = capsys.readouterr()
        assert _shown_in(command.shown, output.out + output.err), (
            f"guide.md:{command.line} does not print what the guide shows:\n{command.shown}\n"
            f"{output.out[-3000:]}")


# --- the documents' code blocks, run as a reader runs them -----------------------------------

SETUP = re.compile(r"(python3? -m venv|\. \S*activate|source \S*activate|pip3? install"
                   r"|python3? -m pip install|python3? -m pytest)(\s|$)")
MAX_RANKS = 4
TIMEOUT_S = 300  # one command


@dataclass
class Command:
    """One command of a block: the text a reader pastes (the shell runs it), its first line in
    the document, why it does not run (None: it runs) and, in a session, the lines it prints."""

    text: str
    line: int
    skip: str | None = None
    shown: list[str] = field(default_factory=list)


@dataclass
class Block:
    line: int
    lines: list[str]  # dedented
    fenced: str | None = None  # the fence's language, None for an indented block

    @property
    def marker(self) -> str | None:
        first = self.lines[0].strip() if self.lines else ""
        if match := re.match(r"#\s*(needs|example output|excerpt)\b", first):
            return match.group(1)
        return None


def _blocks(path: Path) -> list[Block]:
    """The code blocks of a Markdown file: fenced ones, and indented ones (4 columns past the
    text of the paragraph or list item they belong to, after a blank line), blank lines inside
    kept, ending at the first line indented less."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    text_indent, blank_before, i = 0, True, 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if stripped.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            body = [text[indent:] for text in lines[i + 1:end]]
            blocks.append(Block(i + 2, body, fenced=stripped[3:].strip() or "text"))
            i, blank_before = end + 1, False
            continue
        if stripped and blank_before and indent >= text_indent + 4:
            end = i
            while end < len(lines) and (not lines[end].strip()
                                        or len(lines[end]) - len(lines[end].lstrip()) >= indent):
                end += 1
            while not lines[end - 1].strip():
                end -= 1
            blocks.append(Block(i + 1, [text[indent:] for text in lines[i:end]]))
            i, blank_before = end, False
            continue
        if stripped:
            item = re.match(r"(\s*)([-*]|\d+\.)\s+", line)
            text_indent = len(item.group(0)) if item else indent
        blank_before = not stripped
        i += 1
    return blocks


def _comment(text: str) -> str:
    """The shell comment ending a command's last line ('' if none)."""
    last = text.splitlines()[-1]
    for match in re.finditer(r"(?:^|\s)#", last):
        before = last[:match.start()]
        if before.count("'") % 2 == 0 and before.count('"') % 2 == 0:
            return last[match.end():].strip()
    return ""


def _shell_commands(block: Block) -> list[Command]:
    """The commands of a shell block, in order, each with why it does not run, if it does not."""
    lines = block.lines
    session = any(line.startswith("$ ") for line in lines)
    if block.marker == "example output" and not session:
        return []  # output only: no commands in it
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if session and not line.startswith("$ "):
            if commands and line.strip():
                commands[-1].shown.append(line.strip())
            i += 1
            continue
        if not line.strip() or line.strip().startswith("#"):
            i += 1
            continue
        start = i
        while lines[i].rstrip().endswith("\\"):
            i += 1
        if here := re.search(r"<<-?\s*'?(\w+)'?", lines[i]):
            while lines[i].strip() != here.group(1):
                i += 1
        text = "\n".join(lines[start:i + 1])
        commands.append(Command(text[2:] if session else text, block.line + start))
        i += 1
    for before, command in zip([None, *commands], commands, strict=False):
        comment = _comment(command.text)
        if block.marker:
            command.skip = block.marker
        elif comment.startswith("needs"):
            command.skip = "needs"
        elif re.match(r"or\b", comment):
            assert before is not None, f"line {command.line}: an alternative to nothing"
            command.skip = "alternative"
        else:
            kept = [part for part in command.text.split(" && ") if not SETUP.match(part.strip())]
            if not kept:
                command.skip = "setup"
            command.text = " && ".join(kept)
    return commands


def _doc_commands(path: Path) -> list[Command]:
    commands = []
    for block in _blocks(path):
        if block.fenced in ("python", "py"):
            commands.append(Command("python -c " + shlex.quote("\n".join(block.lines)),
                                    block.line, skip=block.marker))
        elif block.fenced is None or block.fenced in ("sh", "bash", "shell", "console"):
            commands.extend(_shell_commands(block))
    return commands


def _words(command: Command) -> list[str]:
    """The command's words, continuations joined and its comment dropped (a here-document's
    lines left out)."""
    text = re.sub(r"\\\n\s*", " ", command.text)
    if re.search(r"<<-?\s*'?\w+'?", text.split("\n")[0]):
        text = text.split("\n")[0]
    return shlex.split(text, comments=True)


def _world(words: list[str]) -> int:
    """Ranks a command starts: --nproc, or torchrun's nodes x processes per node."""
    def value(flag: str, default: int) -> int:
        for i, word in enumerate(words):
            if word == flag:
                return int(words[i + 1])
            if word.startswith(flag + "="):
                return int(word.split("=", 1)[1])
        return default
    if "torchrun" in words:
        return value("--nnodes", 1) * value("--nproc-per-node", 1)
    return value("--nproc", 1)


def _shims(folder: Path) -> Path:
    """A folder of `meshtrain`, `python`, `python3` and `torchrun` that run this interpreter."""
    folder.mkdir()
    targets = {"meshtrain": "-m meshtrain", "python": "", "python3": "",
               "torchrun": "-m torch.distributed.run"}
    for name, args in targets.items():
        shim = folder / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {args} "$@"\n')
        shim.chmod(0o755)
    return folder


def _shown_in(shown: list[str], output: str) -> bool:
    """Every shown line matches a line of the output, in order (`...` matches any text)."""
    lines = iter(line.strip() for line in output.splitlines())
    for expected in shown:
        if expected == "...":
            continue
        pattern = re.compile(".*".join(map(re.escape, expected.split("..."))))
        if not any(pattern.fullmatch(line) for line in lines):
            return False
    return True


def run_document(doc: Path, work: Path) -> list[tuple[int, float, str]]:
    """Run `doc`'s commands in order in `work` (a fresh copy of the files they read); return
    (line, seconds, first words) per command run. Fails at the first command that fails."""
    work.mkdir()
    shutil.copy(ROOT / "README.md", work)
    for folder in ("docs", "examples"):
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shims = _shims(work.parent / "bin")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PATH=f"{shims}{os.pathsep}{os.environ.get('PATH', '')}")
    times = []
    for command in _doc_commands(doc):
        if command.skip:
            continue
        where = f"{doc.name}:{command.line}"
        words = _words(command)
        assert _world(words) <= MAX_RANKS and "cuda" not in words and "HOST" not in command.text, (
            f"{where} needs what this host lacks; mark it `# needs ...`:\n{command.text}")
        started = time.monotonic()
        try:
            result = subprocess.run(["bash", "-c", command.text], cwd=work, env=env, text=True,
                                    stdin=subprocess.DEVNULL, capture_output=True,
                                    timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{where} ran past {TIMEOUT_S} s:\n{command.text}")
        seconds = time.monotonic() - started
        times.append((command.line, seconds, " ".join(words[:6])[:70]))
        output = result.stdout + result.stderr
        error = any(line.startswith("meshtrain: error:") for line in command.shown)
        assert result.returncode == (2 if error else 0), (
            f"{where} exited {result.returncode}:\n{command.text}\n{output[-3000:]}")
        assert _shown_in(command.shown, output), (
            f"{where} does not print what the document shows:\n{command.shown}\n{output[-3000:]}")
    made = sorted(path.name + "/" * path.is_dir() for path in work.iterdir()
                  if path.name not in ("README.md", "docs", "examples"))
    if made and shutil.which("git") and (ROOT / ".git").exists():
        kept = subprocess.run(["git", "check-ignore", "--no-index", "--verbose",
                               "--non-matching", *made], cwd=ROOT, capture_output=True, text=True)
        unignored = [line.split("\t")[-1] for line in kept.stdout.splitlines()
                     if line.startswith("::")]
        assert not unignored, f"{doc.name}'s commands write {unignored}: add them to .gitignore"
    print(f"\n{doc.name}: {len(times)} commands in {sum(t for _, t, _ in times):.1f} s")
    for line, seconds, words in times:
        print(f"  line {line:4d}  {seconds:6.1f} s  {words}")
    return times


def _meshtrain_argv(words: list[str]) -> list[str] | None:
    """The meshtrain arguments of a command's words (after an environment prefix, or under
    torchrun's `-m meshtrain`); None for any other command."""
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        words = words[1:]
    if words[:1] == ["torchrun"] and "-m" in words:
        words = words[words.index("-m") + 1:]
    return words[1:] if words[:1] == ["meshtrain"] else None


def test_outputs_do_not_collide():
    """Read in order, the README then the guide (as a reader follows them in one checkout), no
    command writes an `--out` an earlier one wrote, unless it is a `train` that continues that
    run: `--resume` past the step the run reached, or `--auto-resume` at or past it. A `--resume`
    names a run made before it. Commands shown failing and alternatives write nothing."""
    default_steps = _train_config(build_parser().parse_args(["train"])).train.steps
    reached: dict[str, int | None] = {}  # out -> the step a run there reached (None: not a run)
    for doc in (README, GUIDE):
        for command in _doc_commands(doc):
            argv = _meshtrain_argv(_words(command))
            failing = any(line.startswith("meshtrain: error:") for line in command.shown)
            if argv is None or "--help" in argv or failing or command.skip in ("alternative",
                                                                                 "example output"):
                continue
            where = f"{doc.name}:{command.line}"
            settings = vars(build_parser().parse_args(argv))
            out = settings.get("checkpoint.out", settings.get("out"))
            if out is None:
                continue
            out = os.path.normpath(out)
            if settings["command"] != "train":
                assert out not in reached, f"{where} writes {out}, which an earlier command wrote"
                reached[out] = None
                continue
            steps = settings.get("train.steps", default_steps)
            step = settings.get("train.stop_at") or steps
            before = reached.get(out)
            if settings.get("checkpoint.resume"):
                assert before is not None and step > before, (
                    f"{where} resumes {out}, which holds no run that stopped before step {step}")
            elif settings.get("checkpoint.auto_resume"):
                assert out not in reached or (before is not None and steps >= before), (
                    f"{where} auto-resumes {out} at {steps} steps; a run there reached {before}")
            else:
                assert out not in reached, f"{where} writes {out}, which an earlier command wrote"
            reached[out] = step


def test_the_readme_runs(tmp_path):
    times = run_document(README, tmp_path / "repo")
    assert len(times) >= 8


@pytest.mark.extended
@pytest.mark.timeout(3600)
def test_the_guide_runs(tmp_path):
    times = run_document(GUIDE, tmp_path / "repo")
    assert len(times) >= 60
