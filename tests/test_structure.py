"""The package's shape, read from its source: no import cycles (imports inside functions and
under TYPE_CHECKING count), no module importing the package root, nothing under parallel/
importing models/, no package importing one drawn above it in docs/design.md's module table,
config and checkpointing never importing each other, no two modules of one name, and no code
outside a tensor-parallel scheme's own files comparing scheme names, nor outside the schedules
package schedule names."""

import ast
import re
from pathlib import Path

import pytest

from meshtrain.parallel.schedules.catalog import SCHEDULES
from meshtrain.parallel.schemes.registry import SCHEMES

SRC = Path(__file__).resolve().parents[1] / "src"
DESIGN = SRC.parent / "docs" / "design.md"
PACKAGE = SRC / "meshtrain"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module (a package's name for its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of the package `name` imports anywhere in its file: `from pkg import mod`
    names the module mod, `from pkg import thing` the package pkg itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {target for target in found if target in MODULES and target != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_import_cycles():
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(GRAPH[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_the_package_root():
    offenders = [name for name, targets in GRAPH.items() if "meshtrain" in targets]
    assert not offenders


def test_parallel_never_imports_models():
    offenders = {name: sorted(t for t in targets if t.startswith("meshtrain.models"))
                 for name, targets in GRAPH.items()
                 if name == "meshtrain.parallel" or name.startswith("meshtrain.parallel.")}
    assert not {name: t for name, t in offenders.items() if t}


def test_module_names_are_unique():
    seen: dict[str, list[str]] = {}
    for name in MODULES:
        seen.setdefault(name.rpartition(".")[2], []).append(name)
    assert not {short: names for short, names in seen.items() if len(names) > 1}


def _compared_names(name: str, names: set[str]) -> list[int]:
    """The lines of module `name` that compare a value with one of `names`: `x == "2d"`,
    `x in ("1d", "3d")` and the like."""
    lines = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                values = operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) \
                    else [operand]
                lines += [node.lineno for v in values
                          if isinstance(v, ast.Constant) and v.value in names]
    return lines


@pytest.mark.parametrize("name", sorted(n for n in MODULES
                                        if not n.startswith("meshtrain.parallel.schemes")))
def test_no_scheme_name_is_compared_outside_the_schemes(name):
    """A scheme's behaviour comes from the registry, so a new scheme is its own files plus one
    line."""
    lines = _compared_names(name, set(SCHEMES))
    assert not lines, f"{name}:{lines} compares a scheme name"


@pytest.mark.parametrize("name", sorted(n for n in MODULES
                                        if not n.startswith("meshtrain.parallel.schedules")))
def test_no_schedule_name_is_compared_outside_the_schedules(name):
    """A pipeline schedule's behaviour comes from its object in `catalog.SCHEDULES`, so a new
    schedule is its file plus one line."""
    lines = _compared_names(name, set(SCHEDULES))
    assert not lines, f"{name}:{lines} compares a schedule name"


def test_parallel_building_blocks_sit_below_the_runtime():
    """Inside parallel/: communication < layers < schemes < schedules < runtime; nothing
    imports upwards."""
    order = ["communication", "layers", "schemes", "schedules", "runtime"]
    upward = []
    for name, targets in GRAPH.items():
        parts = name.split(".")
        if parts[:2] != ["meshtrain", "parallel"] or len(parts) < 4:
            continue
        for target in targets:
            other = target.split(".")
            if other[:2] == ["meshtrain", "parallel"] and len(other) >= 4 \
                    and order.index(other[2]) > order.index(parts[2]):
                upward.append(f"{name} -> {target}")
    assert not upward, upward


def _drawn_layers() -> dict[str, int]:
    """Each module or package at the package's top, as docs/design.md's module table draws it
    (bottom to top) -> its row; the parallel/ rows are one layer, drawn where the first is."""
    text = DESIGN.read_text()
    table = text[text.index("Bottom to top:"):].split("\n\n")[1].splitlines()[2:]
    layers: dict[str, int] = {}
    for row, line in enumerate(table):
        for name in re.findall(r"`([^`]+)`", line.split("|")[1]):
            layers.setdefault(name.split("/")[0].removesuffix(".py"), row)
    return layers


def _top(name: str) -> str:
    return name.split(".")[1]


def test_packages_import_only_what_is_drawn_beside_or_below_them():
    """The table in docs/design.md is the layering: `config` before `planner` before
    `training`, and so on; a new package is drawn before it is imported."""
    layers = _drawn_layers()
    tops = {_top(name) for name in MODULES if "." in name} - {"__main__"}
    assert tops <= set(layers), f"not drawn in docs/design.md: {sorted(tops - set(layers))}"
    upward = [f"{name} -> {target}" for name, targets in GRAPH.items()
              if "." in name and _top(name) in layers for target in targets
              if "." in target and layers[_top(target)] > layers[_top(name)]]
    assert not upward, upward


def test_config_and_checkpointing_never_import_each_other():
    """What both need has one owner: a checkpoint's model is read through the format registry
    (`interop.checkpoint_formats`), a resumed run's settings rules are config's
    (`config.resumed_settings`) and which checkpoint it resumes is checkpointing's."""
    pair = {"config", "checkpointing"}
    crossing = [f"{name} -> {target}" for name, targets in GRAPH.items() if "." in name
                for target in targets if "." in target
                and {_top(name), _top(target)} == pair]
    assert not crossing, crossing


def _uses_torch_distributed(path: Path) -> list[int]:
    """Lines of `path` importing or naming torch.distributed."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [ast.unparse(node)] if isinstance(node, ast.Attribute) else []
        lines += [node.lineno for name in names if name.startswith("torch.distributed")]
    return lines


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("meshtrain.planner")))
def test_the_planner_reaches_torch_distributed_only_through_comm(name):
    """Calibration times real collectives, through `parallel/communication/comm.py` like every
    other sender, so what it measures is what training sends."""
    lines = _uses_torch_distributed(MODULES[name])
    assert not lines, f"{name}:{lines} uses torch.distributed"
