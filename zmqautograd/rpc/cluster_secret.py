"""The group's cluster secret: what keeps the rendezvous store from being a back door
(docs/security.md).

Every record a worker publishes in the store is signed with it, and a record that is not is
ignored; over ``encrypt=False`` the members' credentials are bound to it as well. So whoever
can read or write the store, but does not hold the secret, cannot join the group. Where it
comes from, the first one found:

1. ``cluster_secret=`` in the options;
2. the environment: ``ZMQAUTOGRAD_CLUSTER_SECRET`` (the secret itself), or
   ``ZMQAUTOGRAD_CLUSTER_SECRET_FILE`` (a file that holds it, readable by its owner only):
   how launchers pass it to the workers they start, and how hosts share one;
3. a group confined to this host (its store's address is a loopback address, or it is a
   ``file://`` store): the user's *cookie*, ``$XDG_CONFIG_HOME/zmqautograd/cookie`` (default
   ``~/.config/zmqautograd/cookie``), a random secret made on first use, readable by its
   owner only and shared by every group this user starts on this host, as distributed
   Erlang's cookie. Other users of the host, who reach the store's port, cannot join;
4. none: ``init_rpc`` refuses to start, saying the one line to add, since whoever reaches
   the store could join. ``insecure_store=True`` (or ``ZMQAUTOGRAD_INSECURE_STORE=1``)
   starts without one, with a warning that names the risk.

``encrypt=False`` needs a secret always: its credentials would otherwise be readable from
the store.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import stat
from collections.abc import MutableMapping
from pathlib import Path
from urllib.parse import urlparse

from zmqautograd.transport.security import ENVIRONMENT_VARIABLE as SECRET_VARIABLE
from zmqautograd.transport.security import secret_bytes

from .errors import RendezvousError

log = logging.getLogger(__name__)

FILE_VARIABLE = "ZMQAUTOGRAD_CLUSTER_SECRET_FILE"
INSECURE_VARIABLE = "ZMQAUTOGRAD_INSECURE_STORE"
NEW_SECRET = "python3 -c 'import secrets; print(secrets.token_hex(32))'"
ONE_LINE = f"export {SECRET_VARIABLE}=$({NEW_SECRET})"


class ClusterSecretError(RendezvousError):
    """The group has no cluster secret where it needs one, or one that cannot be used."""


def resolve(cluster_secret: str | bytes | None, init_method: str, encrypt: bool = True,
            insecure_store: bool = False) -> bytes | None:
    """This worker's cluster secret (see the module's doc), None where the user opted out
    (or where no store is named at all: the rendezvous then refuses the init_method, with the
    error torch gives for it, and nothing starts)."""
    secret = _given(cluster_secret)
    if secret is None and _store_host(init_method) is None and not init_method.startswith("file://"):
        return None
    if secret is None and not (insecure_store or _insecure_by_environment()):
        if store_is_local(init_method):
            secret = user_cookie()
        else:
            raise ClusterSecretError(
                f"the rendezvous store of {init_method} ({_store_address(init_method)}) can be reached from other "
                "hosts, and this group has no cluster secret: whoever reaches the store could join the group and "
                f"run code on its members. Give every worker the same one: {ONE_LINE} (or cluster_secret= in the "
                "options); on a network you trust, insecure_store=True starts without one")
    if secret is None and not encrypt:
        raise ClusterSecretError(
            "encrypt=False without a cluster secret: the members' credentials would be readable from the "
            f"rendezvous store, and whoever reads it could connect as a member. Give every worker the same "
            f"cluster secret: {ONE_LINE}")
    if secret is None:
        log.warning(
            "insecure_store: this group has no cluster secret, so whoever can write to its rendezvous store (%s) "
            "can join it and run code on its members, and whoever can read the store learns their addresses",
            _store_address(init_method))
    return secret


def _given(cluster_secret: str | bytes | None) -> bytes | None:
    """A secret given by the options or the environment (checked: long enough, private)."""
    given = cluster_secret or os.environ.get(SECRET_VARIABLE)
    if given:
        return secret_bytes(given)
    path = os.environ.get(FILE_VARIABLE)
    if path:
        return _read_private(Path(path).expanduser())
    return None


def _insecure_by_environment() -> bool:
    return os.environ.get(INSECURE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


# ----------------------------------------------------------------------------- the store


def store_is_local(init_method: str) -> bool:
    """Whether the group's store is on this host and named so that only this host reaches
    it: a loopback address (every address the name resolves to), or a file:// store."""
    url = urlparse(init_method)
    if url.scheme == "file":
        return True
    host = _store_host(init_method)
    if not host:
        return False
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False  # (the store cannot be reached either: init_rpc says so)
    try:
        return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)
    except ValueError:
        return False


def _store_host(init_method: str) -> str | None:
    if init_method.startswith("env://"):
        return os.environ.get("MASTER_ADDR")
    return urlparse(init_method).hostname


def _store_address(init_method: str) -> str:
    if init_method.startswith("env://"):
        return f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}"
    url = urlparse(init_method)
    return f"{url.hostname}:{url.port}"


# -------------------------------------------------------------------------------- cookie


def cookie_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "zmqautograd" / "cookie"


def user_cookie() -> bytes:
    """The user's cookie, made on first use (by whichever of several workers starting at
    once gets there first: the others read the same one)."""
    path = cookie_path()
    try:
        secret = _read_private(path)
        _check_private_folder(path.parent)
        return secret
    except FileNotFoundError:
        pass
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private_folder(path.parent)
        temporary = path.with_name(f".cookie-{os.getpid()}-{secrets.token_hex(4)}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as file:
                file.write(secrets.token_hex(32) + "\n")
            try:
                os.link(temporary, path)  # atomic, and never replaces a cookie made meanwhile
            except FileExistsError:
                pass
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as exc:
        raise ClusterSecretError(
            f"cannot make the cookie {path} that secures groups on this host ({exc}): give the workers a cluster "
            f"secret instead ({ONE_LINE}), or set XDG_CONFIG_HOME to a folder this user may write to") from None
    log.info("made the cookie %s: groups this user starts on this host sign their rendezvous with it", path)
    return _read_private(path)


def _check_private_folder(folder: Path) -> None:
    """The cookie's folder must be this user's and writable by it alone: another user who
    could write to it could replace the cookie (as ssh checks ~/.ssh)."""
    status = folder.stat()
    if hasattr(os, "getuid") and (status.st_uid != os.getuid() or status.st_mode & 0o022):
        raise ClusterSecretError(
            f"the folder of the cookie, {folder}, may be written by others (owner uid {status.st_uid}, mode "
            f"{stat.S_IMODE(status.st_mode):o}): it must belong to this user and be writable by it alone "
            f"(chmod 700 {folder})")


def _read_private(path: Path) -> bytes:
    """A secret from a file that only its owner, this user, can read (as ssh's keys)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ClusterSecretError(f"cannot read the cluster secret from {path}: {exc}") from None
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise ClusterSecretError(f"the cluster secret {path} is not a regular file")
        if hasattr(os, "getuid") and (status.st_uid != os.getuid() or status.st_mode & 0o077):
            raise ClusterSecretError(
                f"the cluster secret {path} may be read by others (owner uid {status.st_uid}, mode "
                f"{stat.S_IMODE(status.st_mode):o}): it must belong to this user and be readable by it alone "
                f"(chmod 600 {path})")
        text = file.read().strip()
    try:
        return secret_bytes(text)
    except ValueError as exc:
        raise ClusterSecretError(f"the cluster secret in {path}: {exc}") from None


# ------------------------------------------------------------------------------ launchers


def for_children(environment: MutableMapping[str, str] | None = None) -> bool:
    """For a launcher that starts every worker of a group (``python -m zmqautograd.run``, the
    demo): give the processes it starts a fresh secret of their own, in ``environment``
    (default: this process's, which they inherit), unless one is given already. Whether it
    made one."""
    environment = os.environ if environment is None else environment
    if environment.get(SECRET_VARIABLE) or environment.get(FILE_VARIABLE):
        return False
    environment[SECRET_VARIABLE] = secrets.token_hex(32)
    return True
