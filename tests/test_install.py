"""The distribution installs one import name, `offload`, and so installs beside Hugging Face's `kernels` and the
newest transformers."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_layers import PACKAGES  # each source folder and the package it installs as

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        cwd=out,
        timeout=600,
    )
    (path,) = out.glob("offload-*.whl")
    return zipfile.ZipFile(path)


@pytest.mark.slow
def test_the_wheel_holds_one_top_level_name_and_every_module(wheel):
    names = wheel.namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"offload"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert wheel.read(top_level).decode().split() == ["offload"]
    for folder, package in PACKAGES.items():
        for source in (*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.[ch]")):  # C: the native kernels'
            assert f"{package.replace('.', '/')}/{source.relative_to(ROOT / folder).as_posix()}" in names, source


@pytest.mark.parametrize("where", ["elsewhere", "the repository root"])
def test_hugging_face_kernels_and_transformers_import_beside_the_engine(tmp_path, where):
    """`kernels` is Hugging Face's, transformers' integration with it imports, and the engine's kernels are
    offload.kernels: where the repository's folders are not on sys.path, as an installed engine runs, and from the
    repository root, which `python -c` and `python -m` put first on sys.path (kernels/ holds no __init__.py, so the
    installed distribution wins)."""
    pytest.importorskip("kernels")
    code = (
        "import kernels, transformers.integrations.hub_kernels, offload.kernels.dispatch, offload.tiers.weights.ring;"
        "import offload.scheduler.batcher;"
        "print(kernels.__file__); print(offload.kernels.dispatch.__file__)"
    )
    cwd = tmp_path if where == "elsewhere" else ROOT
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    hf, ours = out.stdout.split()
    assert Path(hf).parent.parent.name == "site-packages"
    assert Path(ours).resolve() == ROOT / "kernels" / "dispatch.py"
