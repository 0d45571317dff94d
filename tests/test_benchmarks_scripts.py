"""The device scripts in benchmarks/ run only on GPUs, so CI cannot run them; it can check that every name they
import from dropless still exists, so that a rename in the library breaks here rather than on the device."""

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("**/*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_script_imports_exist(script):
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dropless"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{script.relative_to(BENCHMARKS)} imports {alias.name} from {node.module}, which has no such name"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dropless"):
                    importlib.import_module(alias.name)
