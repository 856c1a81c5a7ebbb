"""Transport security for the learner's sockets: ZeroMQ CURVE keys, a ZAP authenticator, and peer binding.

Two independent protections:

* **CURVE** (``curve = true``): every learner socket (data, control, weights, telemetry) is a CURVE
  server; the ZAP authenticator (pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator`) accepts only
  clients whose public key is in the ``curve_authorized_keys`` folder (``*.key`` files written by
  ``oakemu keygen``; the folder is read again when it changes). A refused client never completes the
  handshake: it cannot join, send steps or receive weights or telemetry. Refusals are counted.
  Actors and monitors load their own key pair and the learner's public key the same way.
* **Peer binding** (always on): an actor's identity (``actor_id`` + incarnation) is bound at join to the
  connection it joined from, i.e. the peer's address and, with CURVE, its public key. A step, heartbeat
  or leave for that actor from another peer is refused and counted (``impersonation``). The
  incarnation itself is never published (telemetry shows :func:`public_tag` of it), so it cannot be
  read from a monitor and replayed.

Key files are ZeroMQ's own certificate format (``zmq.auth.create_certificates``):
``NAME.key`` (public) and ``NAME.key_secret`` (public + secret, mode 0600).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from oakemu_core.errors import UserError

__all__ = [
    "ZAP_DOMAIN",
    "ClientSecurity",
    "PeerBinding",
    "ServerSecurity",
    "TransportSecurityError",
    "client_security",
    "generate_keypair",
    "is_loopback",
    "peer_of",
    "public_tag",
    "server_security",
]

log = logging.getLogger("oakemu.auth")

ZAP_DOMAIN = "oakemu"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


class TransportSecurityError(UserError, ValueError):
    """A key file or folder is missing or unreadable, or CURVE is on without the keys it needs."""


# --- keys --------------------------------------------------------------------------------------------


def generate_keypair(directory: Path, name: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``directory/NAME.key`` (public) and ``directory/NAME.key_secret`` (mode 0600); returns both paths.

    Raises:
        TransportSecurityError: the name is not a plain file name, or the files exist and not ``overwrite``.
    """
    if not name or "/" in name or name.startswith("."):
        raise TransportSecurityError(f"key name: expected a plain file name, received {name!r}")
    directory = Path(directory)
    public, secret = directory / f"{name}{PUBLIC_SUFFIX}", directory / f"{name}{SECRET_SUFFIX}"
    if not overwrite and (public.exists() or secret.exists()):
        raise TransportSecurityError(f"{public} or {secret} exists already (choose another name or --force)")
    directory.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        written_public, written_secret = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old_umask)
    Path(written_public).chmod(0o644)
    return Path(written_public), Path(written_secret)


def load_keypair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``NAME.key_secret`` file."""
    public, secret = _load(path, "key pair")
    if not secret:
        raise TransportSecurityError(f"{path} holds no secret key: give the NAME{SECRET_SUFFIX} file of `oakemu keygen`")
    return public, secret


def load_public_key(path: Path) -> bytes:
    """The z85 public key in a ``NAME.key`` (or ``NAME.key_secret``) file."""
    return _load(path, "public key")[0]


def _load(path: Path, what: str) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise TransportSecurityError(f"{what} file {path} does not exist (make one with `oakemu keygen`)")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError, zmq.ZMQError) as error:
        raise TransportSecurityError(f"{path} is not a ZeroMQ key file: {error}") from None
    if not public:
        raise TransportSecurityError(f"{path} holds no public key")
    return public, secret


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# --- server (learner) -----------------------------------------------------------------------------


class _AuthorizedKeys:
    """The authorised public keys (a folder of ``*.key`` files), re-read when the folder changes.

    Called by the ZAP authenticator's thread for every new connection; counts refusals.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.lock = threading.Lock()
        self.keys: set[bytes] = set()
        self.stamp: tuple[float, int] | None = None
        self.refused = 0
        self.accepted = 0
        self.reload()

    def reload(self) -> None:
        """Read every ``*.key`` file of the folder (a file that is not a key file is skipped with a warning)."""
        stat = self.folder.stat()
        keys = set()
        for path in sorted(self.folder.glob(f"*{PUBLIC_SUFFIX}")):
            try:
                keys.add(load_public_key(path))
            except TransportSecurityError as error:
                log.warning("ignored in the authorised keys: %s", error)
        with self.lock:
            self.keys = keys
            self.stamp = (stat.st_mtime, stat.st_size)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: allow ``key`` (z85) when it is authorised; count the refusal otherwise."""
        try:
            stat = self.folder.stat()
            if (stat.st_mtime, stat.st_size) != self.stamp:
                self.reload()
        except OSError:
            pass  # the folder vanished: keep the keys read last
        with self.lock:
            allowed = key in self.keys
            if allowed:
                self.accepted += 1
            else:
                self.refused += 1
        if not allowed:
            log.warning("refused a client whose CURVE key is not authorised (%s...)", key[:8].decode(errors="replace"))
        return allowed


@dataclass
class ServerSecurity:
    """CURVE server keys plus the running ZAP authenticator; ``apply`` to every bound socket."""

    public_key: bytes
    secret_key: bytes
    authorized: _AuthorizedKeys
    authenticator: Any  # zmq.auth.thread.ThreadAuthenticator

    def apply(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` a CURVE server in the ZAP domain (before it binds)."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        return sock

    @property
    def refused(self) -> int:
        """Connections refused because the client's key is not authorised."""
        return self.authorized.refused

    def close(self) -> None:
        """Stop the authenticator thread (idempotent)."""
        if self.authenticator.is_alive():
            self.authenticator.stop()


def server_security(context: zmq.Context, config: Any) -> ServerSecurity | None:
    """The learner's CURVE setup from ``config`` (``curve``, ``curve_secret_key``, ``curve_authorized_keys``).

    None when ``curve`` is off (with a warning when the learner binds a non-loopback address).

    Raises:
        TransportSecurityError: CURVE is on but a key file or the authorised-keys folder is missing.
    """
    if not config.curve:
        if not is_loopback(config.bind_host):
            log.warning("the learner's ports on %s accept any client: set curve = true (OAKEMU_CURVE) with keys "
                        "from `oakemu keygen` unless this network is private (deploy/README.md)", config.bind_host)
        return None
    if config.curve_secret_key is None or config.curve_authorized_keys is None:
        raise TransportSecurityError(
            "curve is on: the learner needs curve_secret_key (its NAME.key_secret) and curve_authorized_keys "
            "(the folder of the clients' *.key files)"
        )
    public, secret = load_keypair(config.curve_secret_key)
    folder = Path(config.curve_authorized_keys)
    if not folder.is_dir():
        raise TransportSecurityError(f"curve_authorized_keys {folder} is not a folder")
    authorized = _AuthorizedKeys(folder)
    if not authorized.keys:
        log.warning("no authorised client keys in %s yet: every actor and monitor is refused until one is added",
                    folder)
    from zmq.auth.thread import ThreadAuthenticator  # imported only when CURVE is on (pulls in asyncio)

    authenticator = ThreadAuthenticator(context, log=logging.getLogger("oakemu.auth.zap"))
    authenticator.start()
    authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=authorized)
    log.info("CURVE on: %d authorised client keys in %s", len(authorized.keys), folder)
    return ServerSecurity(public, secret, authorized, authenticator)


# --- clients (actors, monitors) ---------------------------------------------------------------------


@dataclass
class ClientSecurity:
    """A client's CURVE key pair and the learner's public key; ``apply`` to every connecting socket."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes

    def apply(self, sock: zmq.Socket) -> zmq.Socket:
        """Make ``sock`` a CURVE client of the learner (before it connects)."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_serverkey = self.server_key
        return sock


def client_security(config: Any) -> ClientSecurity | None:
    """An actor's or monitor's CURVE setup from ``config`` (``curve``, ``curve_secret_key``, ``curve_server_key``).

    Raises:
        TransportSecurityError: CURVE is on but a key file is missing.
    """
    if not config.curve:
        return None
    if config.curve_secret_key is None or config.curve_server_key is None:
        raise TransportSecurityError(
            "curve is on: actors and monitors need curve_secret_key (their NAME.key_secret) and "
            "curve_server_key (the learner's public .key file)"
        )
    public, secret = load_keypair(config.curve_secret_key)
    return ClientSecurity(public, secret, load_public_key(config.curve_server_key))


# --- peer binding -------------------------------------------------------------------------------------


def peer_of(frame: Any, *, user_id: bool = True) -> tuple[str, str]:
    """(peer address, CURVE user id) of a received frame; empty strings where ZeroMQ has none (inproc, ipc)
    or ``frame`` is not a :class:`zmq.Frame`. ``user_id=False`` skips the user id (without CURVE there is
    none, and asking ZeroMQ for it raises and catches an error per message)."""
    if not isinstance(frame, zmq.Frame):
        return "", ""
    identity = []
    for prop in ("Peer-Address", "User-Id") if user_id else ("Peer-Address",):
        try:
            identity.append(str(frame.get(prop) or ""))
        except (zmq.ZMQError, TypeError, ValueError):
            identity.append("")
    return identity[0], identity[1] if user_id else ""


def public_tag(incarnation: str) -> str:
    """A short, non-authorising tag of an incarnation for telemetry (a hash: cannot be sent back as one)."""
    return hashlib.sha256(incarnation.encode()).hexdigest()[:12]


@dataclass
class PeerBinding:
    """Binds each actor (``actor_id``) to the peer it joined from and refuses its messages from any other.

    ``bind`` at join, ``allows`` for every step, heartbeat and leave. A new join for an actor id that is
    bound to another peer is refused too, while that binding is live (``forget`` it when the actor
    leaves or times out). ``user_ids``: whether peers carry CURVE user ids (the learner's sockets are
    CURVE servers); False skips looking them up.
    """

    peers: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    refused: Counter = field(default_factory=Counter)
    user_ids: bool = True

    def bind(self, actor_id: str, incarnation: str, frame: Any) -> bool:
        """Record the join's peer; False (refused, counted) when ``actor_id`` is live on another peer."""
        address, user = peer_of(frame, user_id=self.user_ids)
        bound = self.peers.get(actor_id)
        if bound is not None and (bound[1], bound[2]) != (address, user):
            self.refused["impersonation"] += 1
            log.warning("refused a join as actor %s from %s: that actor is connected from %s",
                        actor_id, address or "?", bound[1] or "?")
            return False
        self.peers[actor_id] = (incarnation, address, user)
        return True

    def allows(self, actor_id: str, incarnation: str, frame: Any) -> bool:
        """True when this message comes from the peer ``actor_id`` joined from (with its incarnation).

        Messages for actors that are not bound pass: the assembler decides about unknown actors.
        """
        bound = self.peers.get(actor_id)
        if bound is None:
            return True
        if peer_of(frame, user_id=self.user_ids) == (bound[1], bound[2]):
            return True  # the bound peer itself (an old incarnation's late message is the assembler's business)
        self.refused["impersonation"] += 1
        return False

    def forget(self, actor_id: str) -> None:
        """Drop the binding (the actor left or was dropped)."""
        self.peers.pop(actor_id, None)

    def retain(self, live_actor_ids: Any) -> None:
        """Forget every actor not in ``live_actor_ids`` (those the assembler still knows)."""
        for actor_id in [a for a in self.peers if a not in live_actor_ids]:
            del self.peers[actor_id]
