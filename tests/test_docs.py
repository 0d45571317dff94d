"""The docs state what the code is: the architecture page's layers are the import contract's, the
configuration page's key table is what `dropless.core.config` declares, and the planning page's examples are
what `dropless plan` and `dropless train`'s fit check print."""

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dropless import cli
from dropless.core.config import ConfigError, build_config, parse_overrides
from dropless.plan import Cluster, check_fit

ROOT = Path(__file__).resolve().parents[1]


def _contract_layers() -> list[list[str]]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [[name.strip().removeprefix("dropless.") for name in layer.split("|")] for layer in layers]


def _page_layers() -> list[list[str]]:
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = page.split("## Layers", 1)[1].split("```", 2)[1]
    rows = []
    for line in block.splitlines():
        # A layer's row starts with its package names ("models  |  data"), then two or more spaces and a note.
        head = re.split(r"\s{3,}", line.strip(), maxsplit=1)[0] if line.startswith("  ") and line[2] != " " else ""
        if head:
            rows.append([name.strip() for name in head.split("|")])
    return rows


def test_architecture_page_draws_the_contract_layers():
    assert _page_layers() == _contract_layers()


def test_every_package_is_in_a_layer():
    packages = {p.name for p in (ROOT / "src" / "dropless").iterdir()
                if p.is_dir() and (p / "__init__.py").exists() and p.name != "presets"}
    packages |= {p.stem for p in (ROOT / "src" / "dropless").glob("*.py") if p.stem != "__init__"}
    assert packages == {name for layer in _contract_layers() for name in layer}


def test_configuration_page_lists_every_key_as_the_code_declares_it():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_config_docs.py"), "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_architecture_page_lists_every_module_of_each_package():
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \|", page, flags=re.M)
    listed = {package: set(re.findall(r"`(\w+)`", modules)) for package, modules in rows}
    for package_dir in (ROOT / "src" / "dropless").iterdir():
        if (package_dir / "__init__.py").exists() and package_dir.name != "presets":
            modules = {p.stem for p in package_dir.glob("*.py") if p.stem != "__init__"}
            assert listed.get(package_dir.name) == modules, package_dir.name


def _page_examples(page: str, command: str) -> list[tuple[list[str], str]]:
    """(argv, the lines shown under it) of each fenced block of docs/`page` that starts with `$ dropless
    <command>`."""
    blocks, block = [], None
    for line in (ROOT / "docs" / page).read_text().splitlines():
        if line.startswith("```"):
            blocks, block = (blocks + [block], None) if block is not None else (blocks, [])
        elif block is not None:
            block.append(line)
    examples = []
    for first, *shown in filter(None, blocks):
        if first.startswith(f"$ dropless {command} "):
            examples.append((shlex.split(first)[3:], "\n".join(shown)))
    return examples


def test_planning_page_plan_examples_are_what_the_command_prints(capsys):
    examples = _page_examples("planning.md", "plan")
    assert examples, "docs/planning.md shows no `$ dropless plan` example"
    for argv, shown in examples:
        assert cli.main(["plan", *argv]) == 0
        assert capsys.readouterr().out.rstrip("\n") == shown, shlex.join(argv)


def test_planning_page_train_refusal_is_the_fit_checks_message_on_one_h200():
    # On a GPU, `dropless train` checks against the device's limit; the page's H200 is the rate table's 125.8 GiB.
    ((argv, shown),) = _page_examples("planning.md", "train")
    preset = argv[argv.index("--preset") + 1]
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    config = build_config(preset, parse_overrides(overrides))
    with pytest.raises(ConfigError) as refusal:
        check_fit(config, Cluster(1, 1, "H200"), within_margin=True)
    assert f"dropless: error: {refusal.value}" == shown


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("has_gpu, extras", [("yes", ".[test,gpu]"), ("", ".[test]")])
def test_make_setup_installs_the_extras_the_readme_names(tmp_path, has_gpu, extras):
    # README: `make train` / `make test` install `pip install -e '.[test,gpu]'` where nvidia-smi finds a GPU.
    dry_run = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), "setup", f"HAS_GPU={has_gpu}",
                              f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True, check=True).stdout
    assert f"-e '{extras}'" in dry_run, dry_run
