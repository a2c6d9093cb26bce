"""Plugin discovery through real entry points of pip-installed throwaway distributions."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import kvplug
from kvplug import (
    BackendSpec,
    CacheKey,
    MemoryObj,
    PluginConflict,
    PluginLoadError,
    UnknownScheme,
)
from kvplug.hookspecs import InvalidBackendSpec
from kvplug.registry import PluginWarning, create_backend, register_plugin, registry, reset_registry
from kvplug.url import BackendURL
from kvplug_blackhole.backend import BlackholeBackend

DISTS = Path(__file__).parent / "dists"
KEY = CacheKey("registry-test", 1, 0, 7)


def _pip_install_target(target: Path, *dists: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            *(str(DISTS / dist) for dist in dists),
        ],
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="session")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Site directories, each with some throwaway distributions pip-installed into it."""
    layout = {
        "tiny": ("kvplug-tinyplug",),
        "dup": ("kvplug-tinyplug", "kvplug-dup-a", "kvplug-dup-b"),
        "broken": ("kvplug-brokenplug",),
        "lazy": ("kvplug-lazyfail",),
        "bad": ("kvplug-badplugins",),
    }
    sites = {}
    for name, dists in layout.items():
        target = tmp_path_factory.mktemp(f"site-{name}")
        _pip_install_target(target, *dists)
        sites[name] = target
    return sites


@pytest.fixture
def use_site(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Put a site directory on sys.path and rediscover plugins; undone after the test."""

    def activate(site: Path) -> None:
        monkeypatch.syspath_prepend(str(site))
        reset_registry()

    yield activate
    reset_registry()


def _round_trip(url: str) -> bool:
    async def main() -> bool:
        backend = await kvplug.open_backend(url)
        obj = MemoryObj.from_tensor(torch.arange(64, dtype=torch.float16))
        await backend.put(KEY, obj)
        got = await backend.get(KEY)
        assert got is not None
        same = torch.equal(got.tensor, obj.tensor)
        got.release()
        await backend.close()
        return same

    return asyncio.run(main())


def test_installed_distribution_is_discovered_and_opened(sites, use_site) -> None:
    use_site(sites["tiny"])
    assert "tiny" in kvplug.available_schemes()
    info = next(p for p in kvplug.plugins() if p.name == "tiny")
    assert (info.distribution, info.version, info.error) == ("kvplug-tinyplug", "0.0.1", None)
    assert _round_trip("tiny://")


def test_built_in_plugins_register_through_their_entry_points() -> None:
    reset_registry()
    by_name = {p.name: p for p in kvplug.plugins()}
    assert by_name["cpu"].distribution == "kvplug-cpu"
    assert by_name["blackhole"].distribution == "kvplug-blackhole"
    assert by_name["audit"].distribution == "kvplug-audit"
    assert by_name["audit"].specs[0].kind == "wrapper"


def test_scheme_served_twice_names_both_distributions(sites, use_site) -> None:
    use_site(sites["dup"])
    with pytest.raises(PluginConflict) as caught:
        create_backend("dup://")
    message = str(caught.value)
    assert "kvplug-dup-a" in message and "kvplug-dup-b" in message
    assert "KVPLUG_DISABLE_PLUGINS" in message
    # The rest of each conflicting plugin still works.
    assert _round_trip("onlya://") and _round_trip("onlyb://")


def test_disabling_one_plugin_resolves_a_conflict(sites, use_site, monkeypatch) -> None:
    monkeypatch.setenv("KVPLUG_DISABLE_PLUGINS", "kvplug-dup-b")
    use_site(sites["dup"])
    assert _round_trip("dup://")
    assert "onlyb" not in kvplug.available_schemes()


def test_plugin_that_fails_to_import_warns_and_fails_only_when_used(sites, use_site) -> None:
    use_site(sites["broken"])
    with pytest.warns(PluginWarning, match="kvplug-brokenplug"):
        schemes = kvplug.available_schemes()
    assert "cpu" in schemes
    assert _round_trip("cpu://?max_size=16MiB")
    with pytest.raises(UnknownScheme, match="kvplug_a_module_that_does_not_exist"):
        create_backend("broken://")


def test_factory_import_failure_is_an_error_only_when_opened(sites, use_site) -> None:
    use_site(sites["lazy"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "lazy" in kvplug.available_schemes()
    with pytest.raises(PluginLoadError) as caught:
        create_backend("lazy://")
    assert "kvplug-lazyfail" in str(caught.value)
    assert "kvplug_client_library_that_is_not_installed" in str(caught.value)
    with pytest.raises(PluginLoadError, match="not a kvplug Backend"):
        create_backend("notabackend://")


def test_autoload_can_be_disabled(monkeypatch) -> None:
    monkeypatch.setenv("KVPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    reset_registry()
    try:
        assert kvplug.available_schemes() == []
        kvplug.register_backend(BackendSpec("cpu-again", ("mem",), "kvplug_cpu.backend:CpuBackend"))
        assert _round_trip("mem://?max_size=8MiB")
    finally:
        reset_registry()


def test_unknown_scheme_suggests_and_lists() -> None:
    reset_registry()
    with pytest.raises(UnknownScheme) as caught:
        create_backend("cpuu://")
    assert "Did you mean 'cpu'?" in str(caught.value)
    assert "blackhole" in str(caught.value)


def test_first_party_scheme_not_installed_gets_its_pip_line(monkeypatch) -> None:
    monkeypatch.setenv("KVPLUG_DISABLE_PLUGINS", "kvplug-redis")
    reset_registry()
    with pytest.raises(UnknownScheme, match="pip install kvplug-redis"):
        create_backend("redis://127.0.0.1:6379")


def test_register_backend_conflict_and_replace() -> None:
    reset_registry()
    try:
        spec = BackendSpec("mine", ("cpu",), "kvplug_cpu.backend:CpuBackend")
        with pytest.raises(PluginConflict, match="kvplug-cpu"):
            kvplug.register_backend(spec)
        kvplug.register_backend(spec, replace=True)
        assert _round_trip("cpu://?max_size=8MiB")
    finally:
        reset_registry()


def test_wrappers_compose_only_in_front_of_a_backend() -> None:
    reset_registry()
    with pytest.raises(UnknownScheme, match="is a backend, not a wrapper"):
        create_backend("cpu::cpu://")
    with pytest.raises(UnknownScheme, match="needs a backend to wrap"):
        create_backend("audit://")
    backend = create_backend("audit://?verify=true::cpu://?max_size=8MiB")
    assert type(backend).__name__ == "AuditBackend"
    assert _round_trip("audit::cpu://?max_size=8MiB")


@pytest.mark.parametrize(
    ("scheme", "fix"),
    [
        ("my_store", "Write e.g. 'my-store'"),
        ("1abc", "Write e.g. 'abc'"),
        ("", "an empty scheme"),
        ("redis://", "Write 'redis'"),
        ("Acme", "Write 'acme'"),
        ("ac me", "Write e.g. 'ac-me'"),
    ],
)
def test_backend_spec_rejects_what_is_not_a_url_scheme(scheme: str, fix: str) -> None:
    with pytest.raises(InvalidBackendSpec) as caught:
        BackendSpec("acme", ("acme", scheme), "kvplug_acme.backend:AcmeBackend")
    message = str(caught.value)
    assert f"BackendSpec 'acme' declares the scheme {scheme!r}" in message
    assert fix in message
    # A ValueError as before, and a kvplug error naming a broken plugin.
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, PluginLoadError)


@pytest.mark.parametrize("scheme", ["acme", "acme+tls", "redis+sentinel", "a.b-c", "s3", "x"])
def test_every_scheme_a_spec_accepts_parses_in_a_url(scheme: str) -> None:
    spec = BackendSpec("acme", scheme, "kvplug_acme.backend:AcmeBackend")
    assert spec.schemes == (scheme,)
    assert BackendURL.parse(f"{scheme}://").scheme == scheme


@pytest.mark.parametrize("scheme", ["my_store", "1abc", "Acme", "a!b"])
def test_a_scheme_a_spec_rejects_does_not_parse_in_a_url_either(scheme: str) -> None:
    with pytest.raises(InvalidBackendSpec):
        BackendSpec("acme", (scheme,), "kvplug_acme.backend:AcmeBackend")
    with pytest.raises(kvplug.InvalidBackendURL):
        BackendURL.parse(f"{scheme}://")


def test_backend_spec_rejects_no_scheme_and_a_scheme_twice() -> None:
    with pytest.raises(InvalidBackendSpec, match="non-empty tuple"):
        BackendSpec("acme", (), "kvplug_acme.backend:AcmeBackend")
    with pytest.raises(InvalidBackendSpec, match="declares a scheme twice"):
        BackendSpec("acme", ("acme", "acme"), "kvplug_acme.backend:AcmeBackend")
    assert BackendSpec("acme", ["acme"], "m:C").schemes == ("acme",)  # type: ignore[arg-type]


def test_backend_spec_rejects_bad_factories() -> None:
    with pytest.raises(ValueError, match="module:Class"):
        BackendSpec("bad", ("bad",), "no_colon_here")
    with pytest.raises(ValueError, match="kind"):
        BackendSpec("bad", ("bad",), "m:C", kind="middleware")  # type: ignore[arg-type]


def test_cli_lists_an_installed_plugin_end_to_end(sites) -> None:
    env = {**os.environ, "PYTHONPATH": str(sites["tiny"])}
    kvplug_cli = Path(sys.executable).with_name("kvplug")
    listed = subprocess.run(
        [str(kvplug_cli), "plugins", "--json"], env=env, capture_output=True, text=True, check=True
    )
    rows = {row["plugin"]: row for row in json.loads(listed.stdout)}
    assert rows["tiny"]["distribution"] == "kvplug-tinyplug"
    assert rows["tiny"]["backends"][0]["schemes"] == ["tiny"]
    assert {"cpu", "blackhole", "audit"} <= set(rows)
    checked = subprocess.run(
        [str(kvplug_cli), "check", "tiny://", "--rounds", "2"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "OK" in checked.stdout


class FailsToOpen(BlackholeBackend):
    """Takes a resource in _open() and then fails, as a client that connected and then could
    not log in would."""

    instances: ClassVar[list[FailsToOpen]] = []
    resource_held = False

    async def _open(self) -> None:
        FailsToOpen.instances.append(self)
        self.resource_held = True
        raise kvplug.BackendUnavailable("the server refused the log-in")

    async def _close(self) -> None:
        self.resource_held = False
        await super()._close()


def test_a_backend_whose_open_fails_is_closed_before_the_error_reaches_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvplug.registry, "_registry", kvplug.registry.Registry())
    kvplug.register_backend(BackendSpec("fails", ("fails-to-open",), f"{__name__}:FailsToOpen"))
    FailsToOpen.instances.clear()
    with pytest.raises(kvplug.BackendUnavailable, match="refused the log-in"):
        asyncio.run(kvplug.open_backend("fails-to-open://"))
    (backend,) = FailsToOpen.instances
    assert backend.closed and not backend.resource_held


# --- plugins with broken hooks -------------------------------------------------------------


class MisspelledHook:
    """kvplug_backend instead of kvplug_backends: pluggy would register it and never call it."""

    @kvplug.hookimpl
    def kvplug_backend(self) -> list[BackendSpec]:
        return [BackendSpec("never", ("never",), "kvplug_cpu.backend:CpuBackend")]


class WrongArgument:
    """kvplug_backends takes no argument; this one asks for one."""

    @kvplug.hookimpl
    def kvplug_backends(self, config: object) -> list[BackendSpec]:
        return [BackendSpec("never", ("never",), "kvplug_cpu.backend:CpuBackend")]


class Working:
    """A correct plugin object, to show a rejected plugin leaves nothing behind."""

    @kvplug.hookimpl
    def kvplug_backends(self) -> list[BackendSpec]:
        return [BackendSpec("runtime-cpu", ("runtime-cpu",), "kvplug_cpu.backend:CpuBackend")]


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    reset_registry()
    yield
    reset_registry()


@pytest.mark.usefixtures("fresh_registry")
def test_runtime_plugin_with_a_misspelled_hook_is_rejected_naming_the_fix() -> None:
    with pytest.raises(PluginLoadError) as caught:
        register_plugin(MisspelledHook(), name="misspelled")
    message = str(caught.value)
    assert "'misspelled'" in message and "registered at runtime" in message
    assert "'kvplug_backend' is marked @hookimpl but is not a kvplug hook" in message
    assert "Rename it to 'kvplug_backends'" in message
    assert not registry().manager.has_plugin("misspelled")
    assert "never" not in kvplug.available_schemes()


@pytest.mark.usefixtures("fresh_registry")
def test_runtime_plugin_with_a_wrong_argument_is_rejected_naming_the_fix() -> None:
    with pytest.raises(PluginLoadError) as caught:
        register_plugin(WrongArgument(), name="wrong-argument")
    message = str(caught.value)
    assert "'wrong-argument'" in message
    assert "kvplug_backends() takes the argument(s) config" in message
    assert "Declare it as def kvplug_backends()" in message
    assert not registry().manager.has_plugin("wrong-argument")
    assert "never" not in kvplug.available_schemes()


@pytest.mark.usefixtures("fresh_registry")
def test_a_rejected_plugin_leaves_nothing_behind_and_a_fixed_one_registers() -> None:
    with pytest.raises(PluginLoadError):
        register_plugin(MisspelledHook(), name="fixed-later")
    (spec,) = register_plugin(Working(), name="fixed-later")
    assert spec.schemes == ("runtime-cpu",)
    assert _round_trip("runtime-cpu://?max_size=8MiB")
    info = next(p for p in kvplug.plugins() if p.name == "fixed-later")
    assert info.error is None and info.specs == [spec]


@pytest.mark.usefixtures("fresh_registry")
def test_runtime_plugin_serving_an_installed_scheme_is_a_conflict() -> None:
    class ServesCpu:
        @kvplug.hookimpl
        def kvplug_backends(self) -> list[BackendSpec]:
            return [BackendSpec("mine", ("cpu",), "kvplug_cpu.backend:CpuBackend")]

    with pytest.raises(PluginConflict, match="kvplug-cpu"):
        register_plugin(ServesCpu(), name="serves-cpu")
    assert not registry().manager.has_plugin("serves-cpu")
    assert kvplug.registry.backend_class("cpu://").__module__ == "kvplug_cpu.backend"


@pytest.mark.usefixtures("fresh_registry")
def test_a_plugin_given_to_pluggy_directly_is_checked_at_discovery() -> None:
    plugin = MisspelledHook()
    registry().manager.register(plugin, name="past-kvplug")
    with pytest.warns(PluginWarning, match=r"'past-kvplug'.*Rename it to 'kvplug_backends'"):
        schemes = kvplug.available_schemes()
    assert "cpu" in schemes
    assert not registry().manager.is_registered(plugin)


def test_installed_plugins_with_broken_hooks_or_schemes_warn_and_fail_when_used(
    sites, use_site
) -> None:
    use_site(sites["bad"])
    with pytest.warns(PluginWarning) as caught:
        schemes = kvplug.available_schemes()
    messages = {str(w.message).split("'")[1]: str(w.message) for w in caught}
    assert "cpu" in schemes
    assert not {"misspelled", "wrongarg", "badscheme", "bad_scheme"} & set(schemes)
    for name in ("misspelled", "wrongarg", "badscheme"):
        assert "kvplug-badplugins 0.0.1" in messages[name]
        assert f"KVPLUG_DISABLE_PLUGINS={name}" in messages[name]
        assert "its schemes are unavailable" in messages[name]
    assert "Rename it to 'kvplug_backends'" in messages["misspelled"]
    assert "takes the argument(s) config" in messages["wrongarg"]
    assert "the scheme 'bad_scheme'" in messages["badscheme"]
    assert "Write e.g. 'bad-scheme'" in messages["badscheme"]
    # Opening a scheme nobody serves names the broken plugins and what is wrong with them.
    with pytest.raises(UnknownScheme) as unknown:
        create_backend("misspelled://")
    assert "misspelled (kvplug-badplugins)" in str(unknown.value)
    assert "'kvplug_backend' is marked @hookimpl" in str(unknown.value)
