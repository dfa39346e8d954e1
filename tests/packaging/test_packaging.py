"""Issue 25.1: qcoll as users get it. `python -m build` makes the sdist and, from the sdist, the
wheel (CUDA off: the C++ core and the kernel emulator, a few minutes on 2 cores); the wheel
installs into a fresh venv and imports and runs there; its files and metadata are what
pyproject.toml and the requirements files promise."""

from __future__ import annotations

import email.parser
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from qcoll.fsdp import MIN_TORCH

ROOT = Path(__file__).resolve().parents[2]
VERSION = re.search(r'__version__ = "([^"]+)"',
                    (ROOT / "python/qcoll/_version.py").read_text()).group(1)
MODULES = ("_C", "_cuda_emu", "_C_emu")  # the extension modules CMake installs into the package
# The virtual GPU's shared libraries beside them (cmake/virtual_gpu.cmake): _C_emu links the
# emulated CUDA runtime, which qcoll's NCCL loader finds next to the stand-in.
LIBRARIES = ("libqcoll_cudart_emu.so", "libnccl_emu.so")


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-6000:]}"
    return p


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel) from `python -m build`. No isolation: the build requirements are in
    requirements.txt (the README's `pip install .` already builds in an isolated env)."""
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, QCOLL_CUDA="OFF")
    env.setdefault("QCOLL_BUILD_JOBS", str(os.cpu_count() or 2))
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
         env=env, timeout=1500)
    (sdist,) = out.glob("qcoll-*.tar.gz")
    (wheel,) = out.glob("qcoll-*.whl")
    return sdist, wheel


def _requirements(path: Path) -> dict[str, Requirement]:
    reqs = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            r = Requirement(line)
            reqs[r.name] = r
    return reqs


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        return email.parser.Parser().parsestr(
            z.read(f"qcoll-{VERSION}.dist-info/METADATA").decode())


def test_wheel_holds_the_package_and_its_modules(dist):
    _, wheel = dist
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n.split("/")[0] for n in names} == {"qcoll", f"qcoll-{VERSION}.dist-info"}
    sources = {"qcoll/" + p.relative_to(ROOT / "python/qcoll").as_posix()
               for p in (ROOT / "python/qcoll").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == sources
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    compiled = {n for n in names if n.endswith(".so")}
    assert compiled == {f"qcoll/{m}{suffix}" for m in MODULES} | {f"qcoll/{lib}" for lib in LIBRARIES}


def test_wheel_metadata(dist):
    meta = _metadata(dist[1])
    assert meta["Name"] == "qcoll" and meta["Version"] == VERSION
    assert meta["Requires-Python"] == ">=3.10"
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    runtime = [r for r in requires if r.marker is None]
    # A range (GPU users keep their CUDA torch), from the version qcoll.fsdp needs.
    assert [str(r) for r in runtime] == [f"torch>={MIN_TORCH}"]
    assert set(meta.get_all("Provides-Extra")) == {"bench", "test"}
    extras = {e: {r.name: r for r in requires if r.marker and r.marker.evaluate({"extra": e})}
              for e in ("bench", "test")}
    assert set(extras["bench"]) == {"rich", "matplotlib"}
    # The extras and the requirements files the README installs say the same.
    files = _requirements(ROOT / "requirements.txt") | _requirements(ROOT / "requirements-test.txt")
    for extra in extras.values():
        for name, r in extra.items():
            assert name in files and r.specifier == files[name].specifier, (name, r, files.get(name))
    assert set(_requirements(ROOT / "requirements-test.txt")) <= set(extras["test"])


def test_sdist_builds_everything(dist):
    sdist, _ = dist
    top = f"qcoll-{VERSION}/"
    with tarfile.open(sdist) as t:
        names = {n[len(top):] for n in t.getnames() if n.startswith(top)}
    needed = {"pyproject.toml", "CMakeLists.txt", "README.md", "requirements.txt",
              "python/qcoll/_version.py"}
    for folder in ("src", "include", "cmake", "python/qcoll"):
        needed |= {p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts}
    assert needed <= names, sorted(needed - names)
    assert not any(n.startswith(("build/", "bench/results/", ".git/")) for n in names)


def test_wheel_installs_and_runs_in_a_fresh_venv(dist, tmp_path):
    _, wheel = dist
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    # torch from this environment (a fresh download is gigabytes): its site-packages go after
    # the venv's own, so qcoll itself comes from the wheel (checked below).
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
                .stdout.strip())
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    (site / "test_env.pth").write_text("\n".join(ours) + "\n")
    _run([python, "-m", "pip", "install", "--no-index", "--no-deps", "--force-reinstall",
          "--no-cache-dir", str(wheel)])
    check = textwrap.dedent(f"""
        import importlib.metadata as md, sys
        from pathlib import Path
        from packaging.requirements import Requirement
        import torch
        import qcoll, qcoll._C, qcoll._cuda_emu

        venv = Path({str(venv)!r}).resolve()
        for module in (qcoll, qcoll._C, qcoll._cuda_emu):
            assert venv in Path(module.__file__).resolve().parents, module.__file__
        for r in map(Requirement, md.requires("qcoll")):  # runtime needs are met
            if r.marker is None:
                assert r.specifier.contains(md.version(r.name), prereleases=True), r
        info = qcoll.build_info()
        assert info["version"] == qcoll.__version__ == {VERSION!r}, info
        assert info["cuda"] is False, info
        x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
        y = qcoll.dequantize(qcoll.quantize(x, bits=8, group_size=128))
        bound = x.view(-1, 128).abs().amax(1, keepdim=True) / 127 / 2 * (1 + 1e-6)
        assert ((x - y).view(-1, 128).abs() <= bound).all()
        print("ok")
        """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = _run([python, "-c", check], cwd=tmp_path, env=env)  # cwd: no source tree on sys.path
    assert p.stdout.strip().endswith("ok")
    # The virtual GPU's build (it replaces _C, so in a process of its own): it loads from the
    # venv with its emulated CUDA runtime, and the NCCL loader finds the stand-in beside it.
    vgpu = textwrap.dedent(f"""
        from pathlib import Path
        import qcoll
        from qcoll import _nccl
        assert qcoll._C.__name__ == "qcoll._C_emu", qcoll._C.__name__
        assert Path({str(venv)!r}).resolve() in Path(qcoll._C.__file__).resolve().parents
        assert _nccl.nccl_available(), "the NCCL stand-in did not load"
        print("ok")
        """)
    p = _run([python, "-c", vgpu], cwd=tmp_path, env={**env, "QCOLL_VIRTUAL_GPU": "1"})
    assert p.stdout.strip().endswith("ok")
