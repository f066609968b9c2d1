"""Private IPC sockets of one worker's TP ranks: the directory, the socket paths, claiming and cleaning up.

The source's sibling sockets and the target's per-rank sockets live in a
directory only this user can open (mode 0700, checked every time a rank
starts): anyone who can connect could pin blocks or steer READs.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
import tempfile
from pathlib import Path

from remote_g2.errors import ConfigError

__all__ = ["default_ipc_dir", "prepare_ipc_dir", "ipc_endpoint", "claim_ipc_path", "release_ipc_path"]

_SUN_PATH_MAX = 107  # sockaddr_un.sun_path, minus the terminating NUL
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def default_ipc_dir() -> str:
    """``$XDG_RUNTIME_DIR/remote-g2`` when set (already private), else ``/tmp/remote-g2-{uid}``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return str(Path(runtime) / "remote-g2")
    return str(Path(tempfile.gettempdir()) / f"remote-g2-{os.getuid()}")


def prepare_ipc_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` with mode 0700 (parents too), or check that it is private and ours."""
    d = Path(path)
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.lstat()
    except OSError as e:
        raise ConfigError(f"IPC directory {d}: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"IPC directory {d} is not a directory")
    if st.st_uid != os.getuid():
        raise ConfigError(f"IPC directory {d} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        raise ConfigError(f"IPC directory {d} is open to other users (mode {st.st_mode & 0o777:o}); "
                          "use a private directory (mode 0700)")
    return d


def ipc_endpoint(directory: Path, worker_id: str, rank: int) -> str:
    """``ipc://{dir}/{worker_id}_tp{rank}.sock``; unsafe characters in the id become ``_`` plus a digest."""
    safe = _SAFE.sub("_", worker_id)
    if safe != worker_id:  # keep two ids that sanitise alike apart
        safe = f"{safe[:64]}-{hashlib.blake2b(worker_id.encode(), digest_size=4).hexdigest()}"
    path = directory / f"{safe}_tp{rank}.sock"
    if len(str(path)) > _SUN_PATH_MAX:
        raise ConfigError(f"IPC socket path {path} is longer than {_SUN_PATH_MAX} bytes; "
                          "use a shorter ipc_dir or worker id")
    return f"ipc://{path}"


def claim_ipc_path(endpoint: str) -> None:
    """Refuse to bind over a socket someone still serves (ZMQ would silently take it over)."""
    path = endpoint[len("ipc://"):]
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except OSError:  # nobody listens: a stale file from a crashed run
        os.unlink(path)
        return
    finally:
        probe.close()
    raise ConfigError(f"{path} is served by another process: is a source with this worker id running already?")


def release_ipc_path(endpoint: str) -> None:
    """Remove our socket file after the server closed (libzmq leaves it behind)."""
    path = endpoint[len("ipc://"):]
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass
