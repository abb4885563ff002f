"""docker-compose.yml, run as Compose would run it but without Docker (there is no engine on
the development and CI machines): each service on its own 'host' (a network namespace on a
bridge) that finds the others by service name, with the file's own command and environment.
What this does not cover is the image (the Dockerfile's build)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess

import pytest

from tests.netns import Unavailable, bridged_hosts, outputs_of, start_in

yaml = pytest.importorskip("yaml")  # a test extra (pyproject.toml); Compose files are YAML

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What a container's environment would not have: the rendezvous variables of a test runner.
_NOT_INHERITED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def load_services() -> dict[str, dict]:
    with open(os.path.join(ROOT, "docker-compose.yml")) as file:
        return yaml.safe_load(file)["services"]  # safe_load resolves the file's merge keys (<<)


def interpolated(value: str, shell: dict[str, str]) -> str:
    """``value`` as Compose interpolates it from the shell's variables: ``${NAME}``, and
    ``${NAME:?message}``, which refuses to start where NAME is unset or empty."""
    def substitute(match: re.Match) -> str:
        name, required = match.group(1), match.group(2)
        if required is not None and not shell.get(name):
            raise AssertionError(f"compose refuses to start: {name} is unset ({required})")
        return shell.get(name, "")

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::\?([^}]*))?\}", substitute, value)


def service_process(namespace: str, service: dict, shell: dict[str, str]) -> subprocess.Popen:
    command = list(service["command"])
    assert command[0] == "python", command  # the image's interpreter: ours here
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    # A key without a value comes from the shell, and is unset where the shell has none.
    env.update({key: interpolated(str(value), shell) for key, value in service["environment"].items()
                if value is not None})
    env["PYTHONPATH"] = ROOT  # the image has the package installed
    return start_in(namespace, command[1:], env, ROOT)


def test_compose_file_describes_a_driver_and_its_workers():
    services = load_services()
    for service in services.values():  # one cluster secret, from the shell, or compose refuses
        value = service["environment"]["ZMQAUTOGRAD_CLUSTER_SECRET"]
        assert interpolated(value, {"ZMQAUTOGRAD_CLUSTER_SECRET": "s" * 64}) == "s" * 64
        with pytest.raises(AssertionError, match="compose refuses to start"):
            interpolated(value, {})
    ranks = sorted(int(s["environment"]["RANK"]) for s in services.values())
    assert ranks == list(range(len(services)))
    for name, service in services.items():
        env = service["environment"]
        assert int(env["WORLD_SIZE"]) == len(services), name
        # Rank 0 serves the rendezvous; the others find it by its service name.
        assert env["MASTER_ADDR"] in services and services[env["MASTER_ADDR"]]["environment"]["RANK"] == "0"


@pytest.fixture
def service_hosts():
    """The file's services and a host for each: ({service: its description}, {service: its
    namespace})."""
    services = load_services()
    try:
        with bridged_hosts(len(services), hostnames=list(services)) as namespaces:
            yield services, dict(zip(services, namespaces))
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(240)
def test_compose_services_train_on_separate_hosts(service_hosts):
    """All services started at once, in the file's order, as ``docker compose up`` starts
    them (no ``depends_on``: the workers wait for the driver's store themselves). Each host
    reaches the others only over the bridge, so the run trains only if every worker
    advertised an address the others can route to."""
    services, hosts = service_hosts
    shell = {"ZMQAUTOGRAD_CLUSTER_SECRET": secrets.token_hex(32)}  # (what tools/compose.py exports)
    processes = {name: service_process(hosts[name], service, shell) for name, service in services.items()}
    outputs = dict(zip(processes, outputs_of(list(processes.values()), timeout=220)))
    for name, process in processes.items():
        assert process.returncode == 0, f"{name}: {outputs[name][1][-3000:]}"
    driver = next(name for name, s in services.items() if s["environment"]["RANK"] == "0")
    assert "held-out loss" in outputs[driver][0], outputs[driver][0][-2000:]


def test_the_compose_command_without_an_engine_says_why_in_one_line():
    """``dev.py compose`` where no engine runs and none may be started: one line, exit 1, at
    once (the real engine run is .ci/run's ``dev.py compose --faults``)."""
    import sys

    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compose.py"), "--no-start"],
                          env={**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"},
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "no Docker engine answers" in lines[0] or "docker command is missing" in lines[0]
