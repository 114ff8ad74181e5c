"""The package's import layers: every import inside ``hf_sp_trainer`` goes down this list, or stays in its own unit.

``patches`` (the one registry every swap of library code goes through) comes first: every unit may patch.

An AST pass over every module (imports inside functions and ``TYPE_CHECKING`` blocks included): a module of unit
``u`` may import from a unit listed before ``u``, or from ``u`` itself. So no two units import each other, and the
layers read top to bottom: SP primitives and model facts -> features -> composition -> host integration -> entry
points. A new module must be given a place here.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit  # in-process

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hf_sp_trainer"

LAYERS: dict[str, list[str]] = {
    "primitives and model facts": ["patches", "topology", "comm", "sharding", "model", "documents"],
    "features": ["losses", "attention", "multimodal", "memory", "mixers", "collators"],
    "composition": ["validate", "parallel"],
    "host integration": ["integrations", "planner", "trainers"],
    "entry points": ["data", "cli"],
}
ORDER = [unit for units in LAYERS.values() for unit in units]


def _unit(module: str) -> str:
    """``hf_sp_trainer.attention.ring`` -> ``attention``; the package root itself is ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every ``hf_sp_trainer`` import in ``path``, relative ones resolved."""
    name = _module_name(path)
    return _imports_of(path.read_text(), name if path.name == "__init__.py" else name.rsplit(".", 1)[0])


def _imports_of(source: str, package: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                targets = [node.module or ""]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, t) for t in targets if t == "hf_sp_trainer" or t.startswith("hf_sp_trainer.")]
    return found


def _violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        unit = _unit(module)
        if unit == "":  # the package root re-exports the public names (lazily)
            continue
        for line, target in _imports(path):
            if _against_layers(unit, target):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({unit}) imports {target}")
    return bad


def _against_layers(unit: str, target: str) -> bool:
    to = _unit(target)
    return to != unit and (to not in ORDER or ORDER.index(to) > ORDER.index(unit))


def test_every_unit_has_a_layer() -> None:
    units = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    units.discard("__init__")
    assert units == set(ORDER), f"give these a layer: {sorted(units - set(ORDER))}; gone: {sorted(set(ORDER) - units)}"


def test_imports_go_down_the_layers() -> None:
    bad = _violations()
    assert not bad, "imports against the layers (tests/test_layers.py LAYERS):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source, expected",
    [("from ..parallel import x", "hf_sp_trainer.parallel"), ("from . import ring", "hf_sp_trainer.attention.ring")],
)
def test_the_pass_resolves_relative_imports(source: str, expected: str) -> None:
    """The checker itself: relative imports resolve from the module's own package (a wrong resolution would let
    every violation through)."""
    assert [t for _, t in _imports_of(source, "hf_sp_trainer.attention")] == [expected]


def test_the_pass_flags_upward_imports() -> None:
    assert _against_layers("attention", "hf_sp_trainer.parallel")  # a feature reaching up to composition
    assert _against_layers("topology", "hf_sp_trainer")  # the root re-exports everything: never imported inside
    assert not _against_layers("parallel", "hf_sp_trainer.attention.ring")
    assert not _against_layers("attention", "hf_sp_trainer.attention.ring")
