"""Container images made on this machine, for the tests and the local mesh: no image can come
from a public registry here, and none needs to.

``build_image`` packs files of this machine's own Debian into a root file system (a program,
every shared library it loads, and the folders named) and imports it with ``podman import``.
``python_image`` is the one the tests and the example's container variant use: busybox (a
``sh`` and the usual tools), bash (the runtime starts each command with ``bash -c``) and this
machine's Python 3 with its standard library, about 45 MB. An image is built once per content:
its tag carries a digest of what went in, so a later call finds it in podman's store.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path

PYTHON_IMAGE = "localhost/hypermesh-python"
"""The repository of :func:`python_image`; its tag is a digest of its contents."""

_LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")
_SKIP_DIRS = frozenset({"__pycache__", "test", "tests", "idlelib", "tkinter", "turtledemo",
                        "ensurepip", "lib2to3", "pydoc_data"})


def podman() -> str:
    """podman's path, or an error saying how to get it."""
    found = shutil.which("podman")
    if found is None:
        raise FileNotFoundError("no podman: bash scripts/setup.sh installs it")
    return found


def shared_libraries(paths: Iterable[Path]) -> set[Path]:
    """Every shared library the ELF files ``paths`` load, by ``ldd`` (loader included)."""
    found: set[Path] = set()
    for path in paths:
        out = subprocess.run(["ldd", os.fspath(path)], capture_output=True, text=True,
                             check=False).stdout
        for line in out.splitlines():
            match = _LDD_LINE.search(line)
            if match:
                found.add(Path(match.group(1)))
    return found


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _walk(root: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            yield Path(folder) / name


def python_files() -> tuple[list[Path], dict[str, str]]:
    """This machine's files for :func:`python_image`: programs and folders to copy, and the
    links to make (name in the image -> target)."""
    python = Path(os.path.realpath("/usr/bin/python3"))
    stdlib = Path("/usr/lib") / python.name  # python3.11's library is /usr/lib/python3.11
    if not re.fullmatch(r"python3\.\d+", python.name) or not stdlib.is_dir():
        raise FileNotFoundError("no system Python 3 at /usr/bin/python3: apt-get install python3")
    busybox = shutil.which("busybox")
    bash = shutil.which("bash")
    if busybox is None or bash is None:
        raise FileNotFoundError("no busybox or bash: bash scripts/setup.sh installs busybox-static")
    files = [Path(busybox), Path(os.path.realpath(bash)), python, *_walk(stdlib)]
    links = {f"/bin/{tool}": busybox for tool in (
        "sh", "cat", "echo", "env", "false", "id", "ls", "mkdir", "printf", "rm", "sleep",
        "test", "touch", "true", "wc", "head", "tail", "grep", "sed", "kill", "ps")}
    links["/usr/bin/python3"] = python.name
    links["/usr/bin/python"] = python.name
    return files, links


def root_tarball(files: Iterable[Path], links: dict[str, str]) -> bytes:
    """A root file system as a tar archive: ``files`` at their own paths (with the shared
    libraries their ELF files load), ``links`` as symbolic links, and the folders a program
    expects (/tmp, /etc/passwd for ``id``)."""
    wanted = sorted(set(files))
    wanted_set = set(wanted)
    libraries = shared_libraries(p for p in wanted if _is_elf(p))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        added: set[str] = set()

        def add_dir(name: str, mode: int = 0o755) -> None:
            parts = name.strip("/").split("/")
            for i in range(1, len(parts) + 1):
                sub = "/".join(parts[:i])
                if sub and sub not in added:
                    added.add(sub)
                    info = tarfile.TarInfo(sub)
                    info.type = tarfile.DIRTYPE
                    info.mode = mode if i == len(parts) else 0o755
                    tar.addfile(info)

        for folder in ("bin", "usr/bin", "etc", "root", "dev", "proc", "sys", "run"):
            add_dir(folder)
        add_dir("tmp", 0o1777)
        for path in [*wanted, *sorted(libraries - wanted_set)]:
            real = Path(os.path.realpath(path))
            name = str(path).lstrip("/")
            if name in added:
                continue
            add_dir(str(Path(name).parent))
            added.add(name)
            info = tar.gettarinfo(os.fspath(real), arcname=name)
            with open(real, "rb") as f:
                tar.addfile(info, f)
        for name, target in sorted(links.items()):
            name = name.lstrip("/")
            if name in added:
                continue
            add_dir(str(Path(name).parent))
            added.add(name)
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
                           ("etc/group", "root:x:0:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def image_exists(reference: str) -> bool:
    return subprocess.run([podman(), "image", "exists", reference], check=False,
                          capture_output=True).returncode == 0


def build_image(repository: str, files: Iterable[Path], links: dict[str, str]) -> str:
    """Import a root file system of ``files`` as ``repository:DIGEST`` unless podman already
    holds it; the image's full reference."""
    tarball = root_tarball(files, links)
    tag = hashlib.sha256(tarball).hexdigest()[:16]
    reference = f"{repository}:{tag}"
    if not image_exists(reference):
        proc = subprocess.run([podman(), "import", "-", reference], input=tarball,
                              capture_output=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"podman import {reference}: {proc.stderr.decode().strip()}")
    return reference


def python_image() -> str:
    """The image with busybox, bash and this machine's Python (built if missing)."""
    files, links = python_files()
    return build_image(PYTHON_IMAGE, files, links)


if __name__ == "__main__":
    print(python_image())
