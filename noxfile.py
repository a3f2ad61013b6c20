"""Sessions for the monorepo, discovered from ``packages/*/pyproject.toml``.

``nox`` (no arguments) runs lint, typecheck, build and tests_together: the README's test command. ``build``
runs each package's tests against its built wheel installed alone, so ``tests`` (the same tests against an
install of the source folder, for development) is not in it.
Every install goes through a constraints file (``constraints/cpu.txt`` by default, ``NOX_CONSTRAINTS``
overrides it, e.g. ``constraints/gpu-cu130.txt`` on a GPU runner); virtualenvs are reused between runs.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
CONSTRAINTS = os.environ.get("NOX_CONSTRAINTS", "constraints/cpu.txt")
PIP = ["--quiet", "--constraint", CONSTRAINTS]

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "build", "tests_together"]


def import_name(package: str) -> str:
    """``kt-regroup`` -> ``kt_regroup``."""
    return package.replace("-", "_")


def group(package_dir: Path, name: str) -> list[str]:
    """The requirements of PEP 735 dependency group ``name`` of the project in ``package_dir``."""
    return list(nox.project.dependency_groups(nox.project.load_toml(package_dir / "pyproject.toml"), name))


def install_package(session: nox.Session, package: str, *groups: str) -> None:
    """Install one package (with its fbgemm extra, if it has one) and the given dependency groups, through the pins."""
    session.install(*PIP, *package_requirements(package, *groups))


def package_requirements(package: str, *groups: str, editable: bool = False) -> list[str]:
    """pip arguments for one package with the fbgemm extra matching the pins (if any), plus its dependency groups.

    On a GPU runner (``NOX_CONSTRAINTS`` names a gpu- file) the CUDA ``fbgemm`` extra is used and any
    ``fbgemm-gpu-cpu`` a group asks for is dropped: the two distributions provide the same module.
    """
    package_dir = ROOT / "packages" / package
    on_gpu = "gpu-" in CONSTRAINTS
    extra = "fbgemm" if on_gpu else "fbgemm-cpu"
    requirements = [req for name in groups for req in group(package_dir, name)]
    if on_gpu:
        requirements = [req for req in requirements if not req.startswith("fbgemm-gpu-cpu")]
    target = f"{package_dir}[{extra}]" if extra in extras(package_dir) else str(package_dir)
    return [*(["--editable"] if editable else []), target, *requirements]


def extras(package_dir: Path) -> set[str]:
    """The optional-dependency extras the project in ``package_dir`` declares (pipeline-stages has none)."""
    project = nox.project.load_toml(package_dir / "pyproject.toml")["project"]
    return set(project.get("optional-dependencies", {}))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff format + ruff check over the whole tree, then the import-linter independence contract."""
    session.install(*PIP, "ruff", "import-linter")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    src_dirs = os.pathsep.join(str(ROOT / "packages" / p / "src") for p in PACKAGES)
    session.run("lint-imports", env={"PYTHONPATH": src_dirs})


TYPECHECK_VENV = ROOT / ".nox" / "typecheck-shared"
_typecheck_venv_ready: list[bool] = []


def typecheck_python(session: nox.Session) -> str:
    """The interpreter of one venv shared by every ``typecheck`` session, created and filled once per run.

    mypy spends most of its time reading torch; one venv lets the four runs share mypy's cache. It holds all four
    packages (editable), which changes nothing for mypy: a package never imports a sibling (import-linter).
    """
    python = str(TYPECHECK_VENV / "bin" / "python")
    if not _typecheck_venv_ready:
        if not Path(python).exists():
            session.run(sys.executable, "-m", "venv", str(TYPECHECK_VENV))
        requirements = [
            req
            for package in PACKAGES
            for req in package_requirements(package, "typing", "test", editable=True)
        ]
        session.run(python, "-m", "pip", "install", *PIP, *requirements)
        _typecheck_venv_ready.append(True)
    return python


@nox.session(venv_backend="none")
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def typecheck(session: nox.Session, package: str) -> None:
    """mypy --strict over one package's sources and tests."""
    python = typecheck_python(session)
    session.run(
        python,
        "-m",
        "mypy",
        "--cache-dir",
        str(ROOT / ".mypy_cache"),
        f"packages/{package}/src",
        f"packages/{package}/tests",
    )


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests in a venv holding only that package, its dependencies and its test group."""
    install_package(session, package, "test")
    session.run("python", "tools/check_install_alone.py", "--current-env", package)
    session.run("pytest", f"packages/{package}/tests", *session.posargs)


DIST = ROOT / "dist"
# Run inside a wheel's venv: the package must come from that venv's site-packages, not from the checkout.
_FROM_WHEEL = (
    "import importlib, sys; m = importlib.import_module(sys.argv[1]); "
    "assert m.__file__.startswith(sys.prefix), f'{m.__name__} imported from {m.__file__}, not the venv'; "
    "print(f'{m.__name__} {m.__version__} from {m.__file__}')"
)


def wheel_venv(session: nox.Session, package: str, fresh: bool) -> str:
    """The interpreter of ``.nox/wheel-<package>``: a venv that holds only that package's wheel and test group.

    Reused between runs like every nox venv (``fresh`` recreates it); the wheel itself is force-reinstalled.
    """
    path = ROOT / ".nox" / f"wheel-{package}"
    if fresh and path.exists():
        shutil.rmtree(path)
    python = path / "bin" / "python"
    if not python.exists():
        session.run("python", "-m", "venv", str(path))
    return str(python)


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def build(session: nox.Session, package: str) -> None:
    """sdist + wheel of one package into ``dist/<package>``, checked, then its tests against that wheel alone.

    Checks: ``twine check --strict``, ``check-wheel-contents``, ``tools/check_dist.py`` (licence, URLs, a README
    that works on PyPI, the sdist's tests). The wheel (with its fbgemm extra, if any) and the test group go
    into ``.nox/wheel-<package>``; no sibling may be there, the package must import from that venv, and the
    package's tests run there. ``-- --fresh`` recreates that venv; other arguments after ``--`` go to pytest.
    """
    fresh = "--fresh" in session.posargs
    pytest_args = [arg for arg in session.posargs if arg != "--fresh"]
    session.install(*PIP, "build", "twine", "check-wheel-contents")
    out = DIST / package
    shutil.rmtree(out, ignore_errors=True)
    # The isolated build environment resolves hatchling through the same pins.
    pins = {"PIP_CONSTRAINT": str((ROOT / CONSTRAINTS).resolve())}
    session.run("python", "-m", "build", "--outdir", str(out), f"packages/{package}", env=pins)
    artifacts = sorted(str(path) for path in out.iterdir())
    session.run("twine", "check", "--strict", *artifacts)
    wheel = next(path for path in artifacts if path.endswith(".whl"))
    session.run("check-wheel-contents", wheel)
    session.run("python", "tools/check_dist.py", package, str(out))

    python = wheel_venv(session, package, fresh)
    requirements = package_requirements(package, "test")
    target = requirements[0].replace(str(ROOT / "packages" / package), wheel)
    run = functools.partial(session.run, python, external=True)  # the wheel's venv, not the session's
    run("-m", "pip", "install", *PIP, target, *requirements[1:])
    run("-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", wheel)
    run("tools/check_install_alone.py", "--current-env", package)
    run("-c", _FROM_WHEEL, import_name(package))
    run("-m", "pytest", "-p", "no:cacheprovider", f"packages/{package}/tests", *pytest_args)


@nox.session
def tests_together(session: nox.Session) -> None:
    """All packages in one venv: cross-package contracts, integration tests and the example trainer."""
    session.install(*PIP, "-r", "tests/requirements.txt")
    for package in PACKAGES:
        install_package(session, package, "test")
    release_tools = [
        "tools/api_snapshot.py",
        "tools/check_dist.py",
        "tools/check_release.py",
        "tools/gpu_trace_report.py",
        "tools/tests",
    ]
    session.run("mypy", "tests", "examples", *release_tools)
    session.run("pytest", "tests", "examples", "tools/tests", *session.posargs)


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def gpu(session: nox.Session, package: str) -> None:
    """One package's ``gpu``-marked tests; REQUIRE_GPU=1 makes a missing CUDA device fail, not skip."""
    install_package(session, package, "test")
    session.run(
        "pytest", "-m", "gpu", f"packages/{package}/tests", *session.posargs, env={"REQUIRE_GPU": "1"}
    )


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def bench(session: nox.Session, package: str) -> None:
    """``python -m <module>.bench`` for one package; arguments after ``--`` go to the benchmark."""
    install_package(session, package)
    session.install(*PIP, "matplotlib")
    session.run("python", "-m", f"{import_name(package)}.bench", *session.posargs)


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def install_alone(session: nox.Session, package: str) -> None:
    """Install one package into a fresh venv through the pins; it must import and pull in no sibling."""
    session.run("python", "tools/check_install_alone.py", "--fresh-venv", package)


@nox.session
def main_job(session: nox.Session) -> None:
    """The README's main job: the end-to-end DLRM trainer, 2 processes on CPU (gloo)."""
    session.install(*PIP, "-r", "examples/dlrm/requirements.txt")
    for package in PACKAGES:
        install_package(session, package)
    session.run("python", "-m", "examples.dlrm.launch", *session.posargs)
