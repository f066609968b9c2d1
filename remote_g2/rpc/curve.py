"""ZMQ CURVE authentication for TCP endpoints.

Keys are the Z85 certificate files ``zmq.auth`` reads and writes:
``NAME.key`` (public only, safe to hand out) and ``NAME.key_secret``
(public + secret, mode 0600). ``remote-g2 keygen DIR`` makes a pair.

* A server with :class:`CurveServerConfig` encrypts every connection and, when
  ``allowed_clients_dir`` is set, accepts only clients whose public key file
  is in that directory (ZAP); otherwise any client that knows the server's
  public key may connect.
* A client with :class:`CurveClientConfig` needs the server's public key; its
  own key pair is generated per process unless given (needed with an
  allow-list).

IPC sockets never use CURVE: they live in a directory only the worker's user
can open.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from remote_g2.errors import ConfigError

__all__ = ["CurveServerConfig", "CurveClientConfig", "generate_keypair", "load_public_key"]


def generate_keypair(directory: str | os.PathLike[str], name: str = "server") -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` into ``directory``; return both paths."""
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(d), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def _load(path: str | os.PathLike[str], *, need_secret: bool) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"CURVE key file {p} does not exist")
    try:
        public, secret = zmq.auth.load_certificate(str(p))
    except (ValueError, OSError) as e:
        raise ConfigError(f"cannot read CURVE key file {p}: {e}") from e
    if need_secret and not secret:
        raise ConfigError(f"{p} holds no secret key (pass the NAME.key_secret file)")
    return public, secret


def load_public_key(path_or_z85: str) -> bytes:
    """A server public key given as a key file path or as the 40-character Z85 text."""
    if len(path_or_z85) == 40 and not Path(path_or_z85).exists():
        return path_or_z85.encode("ascii")
    return _load(path_or_z85, need_secret=False)[0]


@dataclass(frozen=True)
class CurveServerConfig:
    """The server's key pair and, optionally, the directory of client public keys to admit."""

    public_key: bytes
    secret_key: bytes
    allowed_clients_dir: Path | None = None

    @classmethod
    def from_files(cls, secret_key_file: str | os.PathLike[str],
                   allowed_clients_dir: str | os.PathLike[str] | None = None) -> CurveServerConfig:
        public, secret = _load(secret_key_file, need_secret=True)
        assert secret is not None
        allowed = Path(allowed_clients_dir) if allowed_clients_dir else None
        if allowed is not None and not allowed.is_dir():
            raise ConfigError(f"allowed-clients directory {allowed} does not exist")
        return cls(public, secret, allowed)

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_secretkey = self.secret_key
        socket.curve_publickey = self.public_key
        socket.curve_server = True


@dataclass(frozen=True)
class CurveClientConfig:
    """The server's public key, and this client's key pair (generated when omitted)."""

    server_public_key: bytes
    public_key: bytes | None = None
    secret_key: bytes | None = None

    @classmethod
    def for_server(cls, server_key: str, client_secret_key_file: str | None = None) -> CurveClientConfig:
        server_public = load_public_key(server_key)
        if client_secret_key_file:
            public, secret = _load(client_secret_key_file, need_secret=True)
            return cls(server_public, public, secret)
        return cls(server_public)

    @classmethod
    def from_env(cls, server_key_var: str, env: dict[str, str] | None = None) -> CurveClientConfig | None:
        """From ``$server_key_var`` (the server's public key file or Z85) and, for allow-lists,
        ``$REMOTE_G2_CURVE_CLIENT_KEY`` (this client's secret key file); None when the first is unset."""
        e = os.environ if env is None else env
        key = (e.get(server_key_var) or "").strip()
        if not key:
            return None
        return cls.for_server(key, (e.get("REMOTE_G2_CURVE_CLIENT_KEY") or "").strip() or None)

    def apply(self, socket: zmq.Socket) -> None:
        if self.public_key and self.secret_key:
            public, secret = self.public_key, self.secret_key
        else:
            public, secret = zmq.curve_keypair()
        socket.curve_serverkey = self.server_public_key
        socket.curve_publickey = public
        socket.curve_secretkey = secret
