"""Write or check the public API snapshot of a package: its exported names and their signatures.

The snapshot (``packages/<package>/tests/api_surface.txt``, one line per name, method, property or dataclass
field) is what the package's ``test_api_freeze.py`` compares the imported package with, in the spirit of
torchrec's schema ``api_tests``: a change to a public signature fails the tests until the snapshot is
regenerated, so it shows up as a deliberate diff in review.

Usage (from the repository root)::

    python tools/api_snapshot.py                      # regenerate every package's snapshot from packages/*/src
    python tools/api_snapshot.py vbe-lookup           # one package
    python tools/api_snapshot.py --check              # exit 1 with a unified diff when a snapshot is stale
    python tools/api_snapshot.py --installed --check kt-regroup   # the importable copy, not packages/*/src

Any interpreter that has torch and the packages' dependencies works, e.g. ``.nox/typecheck-shared/bin/python``.

The public surface is the package's ``__init__`` and every public submodule (no leading underscore; the
``bench`` command-line module is left out): for each module its ``__all__`` (or its public names defined in
the package), each object described once under its first public name (later names are aliases), classes with
their public bases, their public methods, properties and dataclass fields, including those inherited from
private bases of the package. ``__version__`` is left out: it changes with every release.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import enum
import importlib
import inspect
import pkgutil
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
SKIPPED_MODULES = {"bench"}
SKIPPED_NAMES = {"__version__"}
# Dunder methods that are part of how a class is used (the rest are implementation).
PUBLIC_DUNDERS = {
    "__init__",
    "__call__",
    "__getitem__",
    "__len__",
    "__iter__",
    "__contains__",
    "__enter__",
    "__exit__",
}
_SIMPLE = (type(None), bool, int, float, str, bytes)
_STARS: dict[Any, str] = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}

__all__ = ["PROBE", "check", "import_name", "probe_copy", "snapshot_path", "surface", "write"]
# The keyword-only parameter :func:`probe_copy` adds to a public method.
PROBE = "api_freeze_probe"


def import_name(package: str) -> str:
    """``kt-regroup`` -> ``kt_regroup``."""
    return package.replace("-", "_")


def snapshot_path(package: str) -> Path:
    """Where the snapshot of ``package`` lives in this repository."""
    return ROOT / "packages" / package / "tests" / "api_surface.txt"


def _public_modules(root: ModuleType) -> list[ModuleType]:
    """The package itself, then its public submodules in name order."""
    names = sorted(info.name for info in pkgutil.iter_modules(root.__path__))
    public = [name for name in names if not name.startswith("_") and name not in SKIPPED_MODULES]
    return [root, *(importlib.import_module(f"{root.__name__}.{name}") for name in public)]


def _exported(module: ModuleType, package: str) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            name
            for name, obj in vars(module).items()
            if not name.startswith("_") and str(getattr(obj, "__module__", "")).startswith(package)
        ]
    return sorted(set(names) - SKIPPED_NAMES)


def _annotation(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation)


def _value(value: Any) -> str:
    """A default or constant as stable text (no memory addresses)."""
    if isinstance(value, _SIMPLE) or (
        isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value)
    ):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    text = repr(value)
    if re.search(r"0x[0-9a-fA-F]+", text) or len(text) > 80:
        return f"<{type(value).__name__}>"
    return text


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(<signature unavailable>)"
    parts: list[str] = []
    star_done = False
    previous = None
    for param in sig.parameters.values():
        if (
            previous is inspect.Parameter.POSITIONAL_ONLY
            and param.kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
        if param.kind is inspect.Parameter.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        prefix = _STARS.get(param.kind, "")
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            star_done = True
        text = prefix + param.name
        if param.annotation is not inspect.Parameter.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not inspect.Parameter.empty:
            text += f" = {_value(param.default)}"
        parts.append(text)
        previous = param.kind
    if previous is inspect.Parameter.POSITIONAL_ONLY:
        parts.append("/")
    result = f"({', '.join(parts)})"
    if sig.return_annotation is not inspect.Signature.empty:
        result += f" -> {_annotation(sig.return_annotation)}"
    return result


def _own(obj: Any, package: str) -> bool:
    return str(getattr(obj, "__module__", "")).split(".")[0] == package


def _class_lines(cls: type, public: str, package: str, names: dict[int, str]) -> list[str]:
    bases = []
    for base in cls.__bases__:
        if id(base) in names:
            bases.append(names[id(base)])
        elif not _own(base, package):
            module = base.__module__
            bases.append(base.__qualname__ if module == "builtins" else f"{module}.{base.__qualname__}")
        # a private base of the package: its members are listed below, its name is not API
    lines = [f"class {public}({', '.join(bases)})"]
    if dataclasses.is_dataclass(cls):
        params = cls.__dataclass_params__  # type: ignore[attr-defined]  # set by @dataclass
        flags = [flag for flag in ("frozen", "eq", "order") if getattr(params, flag)]
        if "__slots__" in vars(cls):
            flags.append("slots")
        lines.append(f"    dataclass({', '.join(flags)})")
        lines.extend(
            f"    field {field.name}: {_annotation(field.type)}" for field in dataclasses.fields(cls)
        )
    if issubclass(cls, enum.Enum):
        lines.extend(f"    member {member.name} = {_value(member.value)}" for member in cls)
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if _own(klass, package):
            members.update(vars(klass))
    for name in sorted(members):
        if name.startswith("_") and name not in PUBLIC_DUNDERS:
            continue
        member = members[name]
        if isinstance(member, property):
            ret = inspect.signature(member.fget).return_annotation if member.fget else inspect.Signature.empty
            kind = "property" if member.fset is None else "property (settable)"
            suffix = "" if ret is inspect.Signature.empty else f" -> {_annotation(ret)}"
            lines.append(f"    {kind} {name}{suffix}")
        elif isinstance(member, staticmethod):
            lines.append(f"    staticmethod {name}{_signature(member.__func__)}")
        elif isinstance(member, classmethod):
            lines.append(f"    classmethod {name}{_signature(member.__func__)}")
        elif inspect.isfunction(member):
            generated = name == "__init__" and dataclasses.is_dataclass(cls)
            if _own(member, package) or generated:
                lines.append(f"    def {name}{_signature(member)}")
    return lines


def surface(package: str) -> list[str]:
    """The public surface of the importable ``package`` (dist or import name), one line per item."""
    root_name = import_name(package)
    root = importlib.import_module(root_name)
    modules = _public_modules(root)
    names: dict[int, str] = {}  # id(object) -> its first public name
    order: list[tuple[str, Any]] = []
    for module in modules:
        for name in _exported(module, root_name):
            obj = getattr(module, name)
            order.append((f"{module.__name__}.{name}", obj))
            names.setdefault(id(obj), f"{module.__name__}.{name}")
    lines: list[str] = []
    for public, obj in order:
        first = names[id(obj)]
        if first != public and not isinstance(obj, _SIMPLE):
            lines.append(f"{public} = {first}")
        elif inspect.isclass(obj):
            lines.extend(_class_lines(obj, public, root_name, names))
        elif hasattr(obj, "__origin__"):  # a typing alias such as ``Callable[[Any], Any]``
            # private module paths inside the alias are not API: show the bare package name
            text = re.sub(rf"\b{root_name}(\._\w+)+\.", f"{root_name}.", repr(obj))
            lines.append(f"alias {public} = {text}")
        elif callable(obj):
            lines.append(f"def {public}{_signature(obj)}")
        elif isinstance(obj, ModuleType):
            lines.append(f"module {public}")
        else:
            lines.append(f"{public}: {type(obj).__name__} = {_value(obj)}")
    return lines


def _render(package: str) -> str:
    header = (
        f"# Public API of {package}: regenerate with `python tools/api_snapshot.py {package}` after a deliberate\n"
        "# change (see the module docstring of tools/api_snapshot.py); packages/*/tests/test_api_freeze.py checks it.\n"
    )
    return header + "\n".join(surface(package)) + "\n"


def _body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def check(package: str, snapshot: Path | None = None) -> str:
    """A unified diff from the snapshot to the importable package ('' when they agree)."""
    path = snapshot or snapshot_path(package)
    expected = _body(path.read_text(encoding="utf-8")) if path.exists() else []
    actual = surface(package)
    diff = difflib.unified_diff(
        expected, actual, fromfile=f"{path.name} (snapshot)", tofile="imported", lineterm=""
    )
    return "\n".join(diff)


def write(package: str) -> Path:
    """Regenerate the snapshot of ``package``; returns its path."""
    path = snapshot_path(package)
    path.write_text(_render(package), encoding="utf-8")
    return path


def _probe_target(package: str) -> tuple[type, str]:
    """The first exported class (by name) with a public method of its own, and that method's name."""
    root = importlib.import_module(import_name(package))
    for name in sorted(getattr(root, "__all__", [])):
        obj = getattr(root, name)
        if not inspect.isclass(obj) or not _own(obj, root.__name__):
            continue
        for attr, member in sorted(vars(obj).items()):
            if (
                not attr.startswith("_")
                and inspect.isfunction(member)
                and member.__qualname__ == f"{name}.{attr}"
            ):
                return obj, attr
    raise LookupError(f"{package} exports no class with a public method to probe")


def probe_copy(package: str, dest: Path) -> str:
    """Copy the importable ``package`` into ``dest`` and give one public method an extra keyword-only parameter.

    Returns ``"<Class>.<method>"``: with ``dest`` first on ``sys.path``, the freeze check must now fail on it
    (a test runs this to show the snapshot catches a signature change).
    """
    root = importlib.import_module(import_name(package))
    cls, method = _probe_target(package)
    package_dir = Path(root.__file__ or "").parent
    copy = dest / root.__name__
    shutil.copytree(package_dir, copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / Path(inspect.getsourcefile(cls) or "").relative_to(package_dir)
    tree = ast.parse(source.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    item.args.kwonlyargs.append(ast.arg(arg=PROBE, annotation=ast.Name(id="int")))
                    item.args.kw_defaults.append(ast.Constant(value=0))
    source.write_text(ast.unparse(tree), encoding="utf-8")
    return f"{cls.__name__}.{method}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "packages", nargs="*", metavar="PACKAGE", help=f"default: all of {', '.join(PACKAGES)}"
    )
    parser.add_argument(
        "--check", action="store_true", help="compare instead of writing; exit 1 on a difference"
    )
    parser.add_argument(
        "--installed",
        action="store_true",
        help="use the importable packages, not packages/*/src of this checkout",
    )
    parser.add_argument("--snapshot", type=Path, help="with --check and one package: compare with this file")
    args = parser.parse_args()
    packages = args.packages or PACKAGES
    unknown = sorted(set(packages) - set(PACKAGES))
    if unknown:
        parser.error(f"`PACKAGE` must be among {', '.join(PACKAGES)}; got {', '.join(unknown)}")
    if not args.installed:
        sys.path[:0] = [str(ROOT / "packages" / p / "src") for p in packages]
    status = 0
    for package in packages:
        if args.check:
            diff = check(package, args.snapshot)
            if diff:
                print(f"{package}: the public API differs from its snapshot:\n{diff}")
                status = 1
            else:
                print(f"{package}: the public API matches its snapshot")
        else:
            print(f"wrote {write(package).relative_to(ROOT)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
