"""scripts/podman_conf.sh, which scripts/setup.sh sources: podman's configuration is written
only where the machine has none of its own, in any place podman reads one from. Run with
bash on fake trees (a system root and a home of their own), never on this machine's."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "podman_conf.sh"
SHIPPED = "usr/share/containers/containers.conf"
WRITTEN = "etc/containers/containers.conf"


def ensure(root: Path, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``podman_conf_ensure ROOT`` with HOME=home and only the variables ``env`` besides."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CONTAINERS_CONF", "CONTAINERS_CONF_OVERRIDE", "XDG_CONFIG_HOME")}
    done = subprocess.run(
        ["bash", "-c", f'set -euo pipefail; source "{SCRIPT}"; podman_conf_ensure "$1"',
         "bash", str(root)],
        env=clean | {"HOME": str(home)} | env, capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done


def tree(tmp_path: Path) -> tuple[Path, Path]:
    root, home = tmp_path / "root", tmp_path / "home"
    root.mkdir()
    home.mkdir()
    return root, home


def ship(root: Path, rel: str, text: str) -> None:
    """``root/rel`` as a package installed it: the file, and its line in dpkg's md5sums."""
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    digest = hashlib.md5(text.encode()).hexdigest()
    with open(info / "golang-github-containers-common.md5sums", "a") as f:
        f.write(f"{digest}  {rel}\n")


# Each place podman reads: (relative to the fake root, or the home), or a variable.
SYSTEM = [
    "etc/containers/containers.conf",
    "etc/containers/containers.conf.d/10-site.conf",
    "etc/containers/containers.rootless.conf.d/10-site.conf",
    "usr/share/containers/containers.conf",  # not as shipped: no md5sums line
    "usr/share/containers/containers.conf.d/10-vendor.conf",
]
USER = [".config/containers/containers.conf", ".config/containers/containers.conf.d/a.conf"]


@pytest.mark.parametrize(
    ("base", "rel"), [("root", r) for r in SYSTEM] + [("home", r) for r in USER])
def test_a_configuration_of_the_machine_or_the_user_is_left_alone(
    tmp_path: Path, base: str, rel: str
) -> None:
    root, home = tree(tmp_path)
    theirs = (root if base == "root" else home) / rel
    theirs.parent.mkdir(parents=True)
    theirs.write_text("# theirs\n")
    ensure(root, home)
    assert theirs.read_text() == "# theirs\n"
    assert not (root / WRITTEN).exists() or theirs == root / WRITTEN


def test_xdg_config_home_is_where_the_users_configuration_is(tmp_path: Path) -> None:
    root, home = tree(tmp_path)
    xdg = tmp_path / "xdg"
    (xdg / "containers").mkdir(parents=True)
    (xdg / "containers" / "containers.conf").write_text("# theirs\n")
    ensure(root, home, XDG_CONFIG_HOME=str(xdg))
    assert not (root / WRITTEN).exists()
    # The variable moves the folder: ~/.config is not read then, so nothing is found there.
    (xdg / "containers" / "containers.conf").unlink()
    (home / ".config" / "containers").mkdir(parents=True)
    (home / ".config" / "containers" / "containers.conf").write_text("# unread\n")
    ensure(root, home, XDG_CONFIG_HOME=str(xdg))
    assert (root / WRITTEN).exists()


@pytest.mark.parametrize("var", ["CONTAINERS_CONF", "CONTAINERS_CONF_OVERRIDE"])
def test_a_configuration_named_by_a_variable_is_left_alone(tmp_path: Path, var: str) -> None:
    root, home = tree(tmp_path)
    ensure(root, home, **{var: str(tmp_path / "theirs.conf")})
    assert not (root / WRITTEN).exists()


def test_an_empty_tree_gets_the_file_once(tmp_path: Path) -> None:
    root, home = tree(tmp_path)
    ensure(root, home)
    text = (root / WRITTEN).read_text()
    assert 'runtime = "runc"' in text and 'cgroup_manager = "cgroupfs"' in text
    assert "default_ulimits = []" in text and 'events_logger = "file"' in text
    (root / WRITTEN).write_text(text + "# edited since\n")
    ensure(root, home)  # idempotent: the file written is the machine's now
    assert (root / WRITTEN).read_text() == text + "# edited since\n"


def test_the_packages_own_defaults_do_not_count_and_an_edited_copy_does(tmp_path: Path) -> None:
    root, home = tree(tmp_path)
    ship(root, SHIPPED, "# the package's defaults, all commented out\n")
    ensure(root, home)
    assert (root / WRITTEN).exists()
    (root / WRITTEN).unlink()
    (root / SHIPPED).write_text("[engine]\nruntime = \"crun\"\n")  # someone edited it
    ensure(root, home)
    assert not (root / WRITTEN).exists()


def test_this_machines_packaged_defaults_are_recognised_as_shipped() -> None:
    """Debian's containers-common ships the file whose checksum its md5sums record."""
    shipped = Path("/") / SHIPPED
    assert shipped.exists(), "bash scripts/setup.sh installs podman"
    done = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; podman_conf_shipped / {SHIPPED}'],
        capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 0, "this machine's defaults differ from its package's"
