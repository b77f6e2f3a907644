"""The source tree keeps its shape: folders of at most 20 modules, modules of at most 800
lines, no import cycle (scripts/check_layout.py), checked on this tree and on broken ones."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_layout.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layout", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check = _checker()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for folder in ("hypermesh", "agent", "chunkfs"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").touch()
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_this_tree_keeps_the_rules() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert done.stdout == "" and done.returncode == 0, done.stdout


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "hypermesh/state/__init__.py": "",
        "hypermesh/state/records.py": "X = 1\n",
        "hypermesh/state/mirror.py": "from hypermesh.state.records import X\n",
        "agent/duty.py": "from hypermesh.state import mirror\n",
    })
    assert check.problems(root) == []


def test_a_cycle_through_a_type_checking_import_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "agent/daemon.py": "from hypermesh.agent.duty import Duty\n",
        "agent/duty.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from hypermesh.agent.daemon import Agent\n"
        ),
    })
    assert check.problems(root) == [
        "import cycle: hypermesh.agent.daemon <-> hypermesh.agent.duty"
    ]


def test_a_cycle_through_a_function_local_and_a_relative_import_is_found(
    tmp_path: Path,
) -> None:
    root = _tree(tmp_path, {
        "hypermesh/local/__init__.py": "",
        "hypermesh/local/mesh.py": "def f():\n    from . import s3server\n",
        "hypermesh/local/s3server.py": "from hypermesh.local import mesh\n",
        "hypermesh/other.py": "import hypermesh.local.mesh\n",
    })
    assert check.problems(root) == [
        "import cycle: hypermesh.local.mesh <-> hypermesh.local.s3server"
    ]


def test_imports_against_the_parts_direction_are_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "hypermesh/state/__init__.py": "",
        "hypermesh/state/mirror.py": "from hypermesh.agent import daemon\n",
        "hypermesh/recipe/__init__.py": "",
        "hypermesh/recipe/recipe.py": "import hypermesh.state.mirror\n",
        "agent/daemon.py": "from hypermesh.state import mirror\n",
        "chunkfs/fs.py": "def f():\n    from hypermesh.agent.daemon import Agent\n",
        "hypermesh/cli.py": "import hypermesh.agent.daemon\nfrom hypermesh.chunkfs import fs\n",
    })
    assert check.problems(root) == [
        "import cycle: hypermesh.agent.daemon <-> hypermesh.state.mirror",
        "wrong way: hypermesh.chunkfs.fs imports hypermesh.agent.daemon"
        " (chunkfs talks to its agent over gRPC only)",
        "wrong way: hypermesh.recipe.recipe imports hypermesh.state.mirror"
        " (the recipe language does not know the mesh's state)",
        "wrong way: hypermesh.state.mirror imports hypermesh.agent.daemon"
        " (the shared core does not import the agent)",
    ]


def test_crowded_folders_and_long_modules_are_named(tmp_path: Path) -> None:
    files = {f"agent/m{i}.py": "" for i in range(21)}
    files["hypermesh/big.py"] = "x = 1\n" * 801
    files["hypermesh/_proto/agent_pb2.py"] = "x = 1\n" * 2000  # generated: exempt
    files.update({f"tests/test_{i}.py": "" for i in range(20)})  # 20 is allowed
    root = _tree(tmp_path, files)
    found = check.problems(root)
    assert found == [
        "agent: 21 modules (at most 20)",
        "hypermesh/big.py: 801 lines (at most 800)",
    ]


def test_every_package_folder_is_installed() -> None:
    """pyproject.toml lists the packages one by one (agent/ and chunkfs/ install under
    hypermesh); a new folder missing from the list would be left out of a wheel."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {module.name for module in check.find_modules(ROOT).values() if module.is_package}
    assert listed == folders
    assert tool["package-data"]["hypermesh.agent.ops"] == ["static/*", "static/vendor/*"]
    assert (ROOT / "agent" / "ops" / "static" / "index.html").is_file()
    assert (ROOT / "agent" / "ops" / "static" / "vendor" / "echarts.min.js").is_file()
