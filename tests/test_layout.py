"""The shape of the tree: each distribution uses only what the others make public, every
distribution has the one version, each plugin and integration tests itself, and the README's
layout table describes the repository as it is."""

from __future__ import annotations

import ast
import contextlib
import importlib
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_PARTS = {"dists", "build", "dist", "node_modules"}


@dataclass(frozen=True)
class Distribution:
    folder: Path
    name: str
    packages: frozenset[str]

    @property
    def label(self) -> str:
        return str(self.folder.relative_to(ROOT))


def _distributions() -> list[Distribution]:
    found = []
    for pyproject in sorted(ROOT.glob("**/pyproject.toml")):
        folder = pyproject.parent
        parts = set(folder.relative_to(ROOT).parts)
        if folder == ROOT or parts & SKIPPED_PARTS or any(p.startswith(".") for p in parts):
            continue
        data = tomllib.loads(pyproject.read_text())
        wheel = data["tool"]["hatch"]["build"]["targets"]["wheel"]
        packages = frozenset(Path(p).name for p in wheel["packages"])
        found.append(Distribution(folder, data["project"]["name"], packages))
    return found


DISTRIBUTIONS = _distributions()
OWNER = {package: dist for dist in DISTRIBUTIONS for package in dist.packages}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def _declared_all(path: Path) -> frozenset[str]:
    """The names a module lists in ``__all__`` (literal lists, tuples and their sums)."""
    constants: dict[str, object] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                with contextlib.suppress(Exception):  # only literal lists and tuples matter
                    code = compile(ast.Expression(node.value), str(path), "eval")
                    constants[target.id] = eval(code, {"__builtins__": {}}, constants)
    return frozenset(constants.get("__all__", ()))  # type: ignore[arg-type]


def _exported(module: str) -> frozenset[str] | None:
    """What ``module`` of another distribution offers: the names its package's and its own
    ``__all__`` list, and its public submodules. None for kvplug itself, whose every module
    and name without a leading underscore is public (the SDK)."""
    parts = module.split(".")
    if parts[0] == "kvplug":
        return None
    src = next(OWNER[parts[0]].folder.glob(f"**/src/{parts[0]}"))
    target = src.joinpath(*parts[1:])
    names = set(_declared_all(src / "__init__.py"))
    if target.is_dir():
        names |= _declared_all(target / "__init__.py")
        names |= {p.stem for p in target.glob("*.py") if not _private(p.stem)}
        names |= {p.name for p in target.iterdir() if (p / "__init__.py").exists()}
    elif target.with_suffix(".py").exists():
        names |= _declared_all(target.with_suffix(".py"))
    return frozenset(names)


def private_imports(files: list[Path], own: frozenset[str]) -> list[str]:
    """Imports in ``files`` of another distribution's private code: a module or name with a
    leading underscore, or, from a plugin or integration, a name that neither its package nor
    its module lists in ``__all__``."""
    problems = []
    for path in files:
        for line, module, names in _imports(path):
            parts = module.split(".")
            owner = OWNER.get(parts[0])
            if owner is None or parts[0] in own:
                continue
            private = [p for p in parts[1:] if _private(p)] + [n for n in names if _private(n)]
            exported = _exported(module)
            if exported is not None:
                # "*" takes exactly the module's __all__, which is what it exports.
                private += [n for n in names if not _private(n) and n not in {*exported, "*"}]
            if private:
                where = f"{path.relative_to(ROOT)}:{line}"
                problems.append(f"{where}: {module} {private} (private to {owner.name})")
    return problems


def _python_files(folder: Path) -> list[Path]:
    return sorted(
        path
        for path in folder.rglob("*.py")
        if not set(path.relative_to(ROOT).parts) & SKIPPED_PARTS
        and not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
    )


def test_every_distribution_is_found() -> None:
    names = {dist.name for dist in DISTRIBUTIONS}
    assert {"kvplug", "kvplug-contracts", "kvplug-cpu", "kvplug-disk", "kvplug-redis"} <= names
    assert {"kvplug-lmcache", "kvplug-sglang", "kvplug-vllm", "kvplug-acme"} <= names


@pytest.mark.parametrize("dist", DISTRIBUTIONS, ids=lambda d: d.label)
def test_no_distribution_imports_another_ones_private_names(dist: Distribution) -> None:
    problems = private_imports(_python_files(dist.folder), dist.packages)
    assert not problems, (
        f"{dist.name} reaches into other distributions' private code; make what it needs "
        "public (no leading underscore, documented) in its home distribution, or keep it "
        "in this one:\n" + "\n".join(problems)
    )


def test_cross_distribution_tests_and_tools_use_only_public_plugin_api() -> None:
    """tests/ holds core's unit tests (which may look inside core) and tests across
    distributions; benchmarks/ and scripts/ are tools. None of them reaches into a plugin's or
    an integration's private code: what a plugin's privates do is tested beside the plugin."""
    files = [
        f for folder in ("tests", "benchmarks", "scripts") for f in _python_files(ROOT / folder)
    ]
    problems = private_imports(files, frozenset({"kvplug"}))
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_private_import(tmp_path: Path) -> None:
    sample = ROOT / "tests" / "_layout_sample.py"
    sample.write_text(
        "from kvplug_cpu.backend import _only_ours\nimport kvplug_redis._private.thing\n"
        "from kvplug_audit.backend import AuditBackend, logger\n"
        "from kvplug_cpu import CpuBackend\nfrom kvplug.backend import _GATES, Backend\n"
    )
    try:
        problems = private_imports([sample], frozenset({"kvplug"}))
    finally:
        sample.unlink()
    assert len(problems) == 3, problems
    assert "_only_ours" in problems[0] and "kvplug-cpu" in problems[0]
    assert "_private" in problems[1]
    assert "['logger']" in problems[2]


# -- one version ---------------------------------------------------------------------------


def _pyproject(dist: Distribution) -> dict[str, object]:
    return tomllib.loads((dist.folder / "pyproject.toml").read_text())


OURS = [dist for dist in DISTRIBUTIONS if dist.folder.parent.name != "examples"]


@pytest.mark.parametrize("dist", OURS, ids=lambda d: d.label)
def test_the_version_and_sibling_pins_come_from_the_one_version_file(dist: Distribution) -> None:
    data = _pyproject(dist)
    project = data["project"]
    assert isinstance(project, dict)
    assert "version" not in project, "the version is VERSION's, through scripts/hatch_kvplug.py"
    assert {"version", "dependencies"} <= set(project["dynamic"])
    hook = data["tool"]["hatch"]["metadata"]["hooks"]["custom"]  # type: ignore[index]
    assert (dist.folder / hook["path"]).resolve() == ROOT / "scripts" / "hatch_kvplug.py"
    requirements = list(hook.get("dependencies", []))
    for extra in hook.get("optional-dependencies", {}).values():
        requirements += extra
    for requirement in requirements:
        if requirement.startswith("kvplug"):
            assert not re.search(r"[<>=~!]", requirement), (
                f"{dist.name} pins {requirement!r}: name a sibling without a version; the "
                "hook pins it to VERSION's series"
            )


def test_no_package_writes_a_version_of_its_own() -> None:
    version = (ROOT / "VERSION").read_text().strip()
    written = [
        f"{path.relative_to(ROOT)}"
        for dist in OURS
        for path in _python_files(dist.folder)
        if re.search(rf"__version__\s*=\s*[\"']{re.escape(version)}", path.read_text())
    ]
    assert not written, f"these define the version again instead of reading it: {written}"


def test_the_hook_pins_siblings_to_the_series() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("hatch_kvplug", ROOT / "scripts/hatch_kvplug.py")
    assert spec and spec.loader
    hook = importlib.util.module_from_spec(spec)
    pytest.importorskip("hatchling")
    spec.loader.exec_module(hook)
    pinned = hook.pin_siblings(["kvplug", "kvplug-disk[gds]", "redis>=5", "kvplug-x>=1"], "0.3.1")
    assert pinned == ["kvplug~=0.3.1", "kvplug-disk[gds]~=0.3.1", "redis>=5", "kvplug-x>=1"]


# -- each plugin and integration tests itself ---------------------------------------------


SELF_TESTED = [
    dist
    for dist in DISTRIBUTIONS
    if dist.folder.parent.name in {"plugins", "integrations", "examples"}
]


@pytest.mark.parametrize("dist", SELF_TESTED, ids=lambda d: d.label)
def test_each_plugin_and_integration_runs_the_contract_in_its_own_tests(dist: Distribution) -> None:
    tests = dist.folder / "tests"
    subclass = re.compile(r"^class \w+\((\w+, )*BackendContract\):", re.MULTILINE)
    contract_tests = [path for path in tests.glob("test_*.py") if subclass.search(path.read_text())]
    assert contract_tests, f"{dist.label}/tests has no BackendContract subclass"


# -- the README's layout table -------------------------------------------------------------


def _layout_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)` \|(.*)\|\s*$", line)
        if match:
            rows[match.group(1).rstrip("/")] = match.group(2)
    return rows


CONTAINERS = {"plugins", "integrations", "examples"}


def _tracked_folders() -> set[str]:
    """The repository's folders, as README names them: top-level ones, and each one inside
    plugins/, integrations/ and examples/ (the distributions)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked folders are unknown")
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    folders = set()
    for name in files:
        parts = Path(name).parts
        if len(parts) < 2:
            continue
        if parts[0] in CONTAINERS:
            if len(parts) > 2:
                folders.add(f"{parts[0]}/{parts[1]}")
        else:
            folders.add(parts[0])
    return folders


def test_the_layout_table_lists_every_folder_of_the_repository() -> None:
    listed = set(_layout_rows())
    folders = _tracked_folders()
    assert folders - listed == set(), (
        f"folders missing from README's layout table: {folders - listed}"
    )
    assert listed - folders == set(), f"rows naming no folder of the repository: {listed - folders}"


def test_the_layout_table_links_only_inside_the_repository() -> None:
    for folder, row in _layout_rows().items():
        for target in re.findall(r"\]\(([^)]+)\)", row):
            assert not re.match(r"[a-z]+://", target), f"{folder}: {target} leaves the repository"
            path = (ROOT / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), f"{folder}: {target} is not here"


# -- core: the vendor SDK apart from the runtime, and no module doing several jobs -----------


KVPLUG = ROOT / "core" / "src" / "kvplug"

MAX_MODULE_LINES = 800
"""The ceiling of a source module: past it, a module is doing more than one job."""

MOVED = {
    "kvplug.store": "kvplug.runtime.store",
    "kvplug.sync": "kvplug.runtime.sync",
    "kvplug.integration": "kvplug.runtime.engine",
    "kvplug.config": "kvplug.runtime.config",
    "kvplug.gpu": "kvplug.runtime.gpu",
    "kvplug.metrics": "kvplug.runtime.metrics",
}
"""Each import path kept for code written before the runtime had its package, and its home."""

SDK_CROSSINGS = {
    "kvplug.env": {
        "kvplug.runtime.config": "a plugin's KVPLUG_<PLUGIN>_* variables are those the core "
        "config does not own (imported on first call)",
    },
}
"""The SDK's only imports of the runtime, each with its reason."""

PLUGIN_PROGRAMS = ("kvplug_lm.server", "kvplug_lm.command")
"""Plugin modules that are programs of their own (the lm:// server), free to use the runtime."""


def _runtime_imports(path: Path) -> set[str]:
    homes = ("kvplug.runtime", *MOVED)
    return {
        name
        for _, module, names in _imports(path)
        for name in (module, *(f"{module}.{n}" for n in names))
        if any(name == home or name.startswith(f"{home}.") for home in homes)
    }


def _source_modules() -> list[Path]:
    return [
        path
        for dist in DISTRIBUTIONS
        for package in dist.packages
        for path in _python_files(next(dist.folder.glob(f"**/src/{package}")))
    ]


def test_no_source_module_is_past_the_size_ceiling() -> None:
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in _source_modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, (
        f"source modules over {MAX_MODULE_LINES} lines: {too_long}. Split each by "
        "responsibility, into modules named for their one job."
    )


def test_the_vendor_sdk_imports_nothing_of_the_runtime() -> None:
    shims = {KVPLUG / f"{old.removeprefix('kvplug.')}.py" for old in MOVED}
    crossings = {}
    for path in sorted(set(KVPLUG.glob("*.py")) - shims - {KVPLUG / "__init__.py"}):
        allowed = SDK_CROSSINGS.get(f"kvplug.{path.stem}", {})
        found = {
            name
            for name in _runtime_imports(path)
            if not any(name == home or name.startswith(f"{home}.") for home in allowed)
        }
        if found:
            crossings[path.name] = found
    assert not crossings, (
        f"SDK modules import the runtime: {crossings}. A vendor reads kvplug's SDK without the "
        "Store, the engine helpers or the CLI: move the shared piece into the SDK or, where the "
        "crossing is needed, list it with its reason in SDK_CROSSINGS."
    )


def test_the_front_door_names_only_the_runtimes_config() -> None:
    config = "kvplug.runtime.config"
    assert _runtime_imports(KVPLUG / "__init__.py") <= {
        config,
        *(f"{config}.{name}" for name in ("Config", "TierConfig", "load_config")),
    }


def test_backend_plugins_are_written_against_the_sdk_only() -> None:
    crossings = {}
    for dist in DISTRIBUTIONS:
        if dist.folder.parent.name != "plugins":
            continue
        for path in _python_files(dist.folder / "src"):
            dotted = ".".join(path.relative_to(dist.folder / "src").with_suffix("").parts)
            if not dotted.startswith(PLUGIN_PROGRAMS) and (found := _runtime_imports(path)):
                crossings[dotted] = found
    assert not crossings, (
        f"backend plugins import kvplug's runtime: {crossings}. A backend needs only the SDK "
        "(kvplug.backend, memory, keys, frame, serde, errors, options, url)."
    )


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_import_path_from_before_the_move_names_the_same_objects(old: str) -> None:
    shim, home = importlib.import_module(old), importlib.import_module(MOVED[old])
    assert shim.__all__ == home.__all__
    for name in home.__all__:
        assert getattr(shim, name) is getattr(home, name), f"{old}.{name}"


def test_the_imports_users_wrote_keep_working_and_the_runtime_imports_light() -> None:
    script = (
        "import sys\n"
        "import kvplug, kvplug.runtime\n"
        "assert 'torch' not in sys.modules, 'import kvplug.runtime loaded torch'\n"
        "from kvplug.store import Store, StoreOptions, open_store\n"
        "from kvplug.sync import SyncClient\n"
        "from kvplug.config import Config, load_config\n"
        "from kvplug.integration import EngineIO, CallHealth\n"
        "from kvplug.gpu import PagedKVCache, gather, scatter, offload, load\n"
        "from kvplug.metrics import StoreMetrics\n"
        "assert kvplug.Config is Config and kvplug.load_config is load_config\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
