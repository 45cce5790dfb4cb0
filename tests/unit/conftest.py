"""Fixtures of the unit tests: Quiver's native library in each of its builds."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def native_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Quiver's native library as this machine builds it, and its other two paths (AVX2; portable C) built
    for an older x86."""
    import shutil
    import subprocess

    from quiver.backends.cpu.native_ops import SOURCES, built_library

    built = built_library()
    assert isinstance(built, Path), f"the kernel could not be built here: {built}"
    folder = tmp_path_factory.mktemp("builds")
    made = {"native": built}
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    for name, march in (("avx2", "haswell"), ("portable", "x86-64")):
        made[name] = folder / f"{name}.so"
        command = [compiler, "-O3", f"-march={march}", "-shared", "-fPIC", "-o", str(made[name]), *map(str, SOURCES)]
        subprocess.run([*command, "-lm"], check=True)
    return made
