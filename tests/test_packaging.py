"""The three distributions of this repository: the service (``agent-runtime``, ``src/``), the
Kubernetes API simulator (``agent-runtime-kubesim``, ``kubesim/``) and the gateway's client
(``agent-runtime-client``, ``client/``: httpx alone, nothing of the service).

Both wheels are built here, offline, with the venv's own build backend (``pip wheel --no-deps
--no-build-isolation``; hatchling is in requirements.lock): the service's wheel carries no
simulator, the simulator's carries nothing of the service and imports only the standard
library, itself and the dependencies it declares. ``agent-runtime kubesim`` without the
simulator installed ends with one line saying how to install it (exit 2). The image's build
context keeps the simulator out too: ``tests/test_deploy.py`` (.dockerignore).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from agent_runtime import cli

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT = 120.0  # per wheel; a few seconds on a quiet machine


def build_wheel(project: Path, out: Path) -> zipfile.ZipFile:
    env = {**os.environ, "PIP_NO_INDEX": "1"}  # offline: the backend is the venv's own
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(project)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"pip wheel {project} failed:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def service_wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(ROOT, tmp_path_factory.mktemp("service-wheel"))


@pytest.fixture(scope="module")
def kubesim_wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(ROOT / "kubesim", tmp_path_factory.mktemp("kubesim-wheel"))


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(ROOT / "client", tmp_path_factory.mktemp("client-wheel"))


def top_level(wheel: zipfile.ZipFile) -> set[str]:
    """The wheel's top-level folders, its one .dist-info folder named as ``*.dist-info``."""
    names = {name.split("/")[0] for name in wheel.namelist()}
    dist_info = {n for n in names if n.endswith(".dist-info")}
    assert len(dist_info) == 1, dist_info
    return names - dist_info | {"*.dist-info"}


def metadata(wheel: zipfile.ZipFile) -> tuple[str, list[str], str]:
    """(name, Requires-Dist without extras-only ones, entry_points.txt) of a wheel."""
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    message = Parser().parsestr(wheel.read(meta).decode())
    requires = [
        Requirement(r).name
        for r in message.get_all("Requires-Dist") or []
        if "extra ==" not in r.replace('"', "").replace("'", "")
    ]
    points = meta.replace("METADATA", "entry_points.txt")
    entry_points = wheel.read(points).decode() if points in wheel.namelist() else ""
    return message["Name"], requires, entry_points


def imported_top_levels(source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.timeout(2 * BUILD_TIMEOUT)
def test_the_service_wheel_carries_no_simulator(service_wheel: zipfile.ZipFile) -> None:
    names = service_wheel.namelist()
    assert top_level(service_wheel) == {"agent_runtime", "*.dist-info"}
    assert not [n for n in names if "kubesim" in n], "a simulator file in the service's wheel"
    assert not [n for n in names if "agent_runtime_client" in n], "a client file in the service's"
    assert {"agent_runtime/cli.py", "agent_runtime/session_manager/lua/touch.lua"} <= set(names)
    name, requires, entry_points = metadata(service_wheel)
    assert name == "agent-runtime"
    assert not [r for r in requires if "kubesim" in r]
    assert "agent-runtime = agent_runtime.cli:main" in entry_points
    assert "kubesim" not in entry_points


@pytest.mark.timeout(2 * BUILD_TIMEOUT)
def test_the_simulator_wheel_is_the_simulator_alone(kubesim_wheel: zipfile.ZipFile) -> None:
    assert top_level(kubesim_wheel) == {"kubesim", "*.dist-info"}
    name, requires, entry_points = metadata(kubesim_wheel)
    assert name == "agent-runtime-kubesim"
    assert requires == ["aiohttp"]
    assert "kubesim = kubesim.runner:main" in entry_points
    sources = [n for n in kubesim_wheel.namelist() if n.endswith(".py")]
    assert "kubesim/sim.py" in sources and "kubesim/__main__.py" in sources
    # nothing of the service, and no dependency it does not declare
    allowed = set(sys.stdlib_module_names) | {"kubesim", *requires}
    for source in sources:
        imported = imported_top_levels(kubesim_wheel.read(source).decode())
        assert imported <= allowed, f"{source} imports {sorted(imported - allowed)}"


@pytest.mark.timeout(2 * BUILD_TIMEOUT)
def test_the_client_wheel_is_the_client_alone_over_httpx(client_wheel: zipfile.ZipFile) -> None:
    assert top_level(client_wheel) == {"agent_runtime_client", "*.dist-info"}
    name, requires, entry_points = metadata(client_wheel)
    assert name == "agent-runtime-client"
    assert requires == ["httpx"]  # no FastAPI, Redis or SQL: a gateway installs it alone
    assert entry_points == ""
    sources = [n for n in client_wheel.namelist() if n.endswith(".py")]
    assert "agent_runtime_client/core.py" in sources
    assert "agent_runtime_client/py.typed" in client_wheel.namelist()
    allowed = set(sys.stdlib_module_names) | {"agent_runtime_client", *requires}
    for source in sources:
        imported = imported_top_levels(client_wheel.read(source).decode())
        assert imported <= allowed, f"{source} imports {sorted(imported - allowed)}"


def test_the_kubesim_command_without_the_simulator_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kubesim", None)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "kubesim.runner", None)  # type: ignore[arg-type]
    for argv in (["kubesim"], ["kubesim", "--port", "8001", "--jitter", "0.1"], ["kubesim", "-h"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err == f"agent-runtime: error: {cli.KUBESIM_MISSING}\n"
        assert "pip install -e ./kubesim" in err
    # the other commands are as before: an unknown option is still a usage error
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--no-such-option"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


@pytest.mark.parametrize("cwd", ["elsewhere", "repository root"])
def test_agent_runtime_kubesim_in_an_environment_without_it(cwd: str, tmp_path: Path) -> None:
    """A real process whose environment has the service's dependencies but not the simulator:
    site-packages on the path without its .pth files (``-S``), so neither editable install is
    seen; the service from ``src/``. From the repository root ``kubesim/`` is a namespace
    package without the simulator in it: the same answer."""
    site_packages = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *site_packages])}
    code = "import sys; from agent_runtime.cli import main; sys.argv[0] = 'agent-runtime'; main()"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code, "kubesim", "--port", "8001"],
        cwd=ROOT if cwd == "repository root" else tmp_path,
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == f"agent-runtime: error: {cli.KUBESIM_MISSING}\n"
