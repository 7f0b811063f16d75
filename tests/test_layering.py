"""The package's layering and size rules, read from the source (`docs/architecture.md`, "Layout"):

- the product never imports its test package (`swarmnode.testing`): a faulty node is the test package's own
  entry point, which installs a filter through the node's one hook (`server.output_hook`);
- the planner is plain data in, plain data out: no torch, hivemind, transformers, or the node's runtime;
- no product module over 900 lines and no product function over 80, so that each stays readable.

Imports are read with `ast`, lazy ones inside functions included, so a check cannot be dodged by moving an
import into a function body.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the product's folders and the package each is installed as (pyproject.toml's package-dir)
PRODUCT = {"swarmnode": "swarmnode", "client": "swarmnode.client", "planner": "swarmnode.planner",
           "bootstrap": "swarmnode.bootstrap"}
MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 80


def _modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _product_modules() -> list[Path]:
    return [p for folder in PRODUCT for p in _modules(folder) if "testing" not in p.relative_to(ROOT).parts[1:2]]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, relative ones resolved against its package."""
    folder = path.relative_to(ROOT).parts[0]
    package = [*PRODUCT.get(folder, folder).split("."), *path.relative_to(ROOT / folder).parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _named(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_rules_see_every_product_folder_and_resolve_imports():
    modules = _product_modules()
    assert {p.relative_to(ROOT).parts[0] for p in modules} == set(PRODUCT)
    assert not any("testing" in p.relative_to(ROOT).parts[:2] for p in modules)
    # a relative import is resolved against the installed package (planner/ is swarmnode.planner), from a
    # subpackage too (planner/costs/ is swarmnode.planner.costs: `..cluster.spec` is swarmnode.planner.cluster.spec)
    figures = {m for _, m in _imports(ROOT / "planner" / "costs" / "replica_figures.py")}
    assert {"swarmnode.planner.cluster.spec.Cluster", "swarmnode.planner.costs.hexgen_gpus.Task"} <= figures


def test_the_product_never_imports_its_test_package():
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _product_modules()
                 for line, name in _imports(p) if _named(name, ("swarmnode.testing",))]
    assert offenders == []


def test_the_planner_imports_no_torch_network_or_runtime():
    banned = ("torch", "hivemind", "transformers", "safetensors", "swarmnode.runtime", "swarmnode.server",
              "swarmnode.client", "swarmnode.coordinator", "swarmnode.dht", "swarmnode.relay", "swarmnode.testing")
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _modules("planner")
                 for line, name in _imports(p) if _named(name, banned)]
    assert offenders == []


@pytest.mark.parametrize("limit", ["module", "function"])
def test_no_product_module_or_function_is_too_long(limit):
    too_long = []
    for path in _product_modules():
        text = path.read_text()
        if limit == "module":
            lines = len(text.splitlines())
            if lines > MAX_MODULE_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == [], f"over {MAX_MODULE_LINES if limit == 'module' else MAX_FUNCTION_LINES} lines"


def test_prepare_model_offers_every_tiny_family():
    from swarmnode.cli.prepare_model import TINY_CHOICES
    from swarmnode.tiny_models import TINY_FAMILIES

    assert TINY_CHOICES == TINY_FAMILIES
