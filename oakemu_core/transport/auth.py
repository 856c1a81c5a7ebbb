"""Transport security for the learner's sockets: ZeroMQ CURVE keys, a ZAP authenticator, and peer binding.

Two independent protections:

* **CURVE** (``curve = true``): every learner socket (data, control, weights, telemetry) is a CURVE
  server; the ZAP authenticator (pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator`) accepts only
  clients whose public key the ``curve_authorized_keys`` folder authorises for the socket's **role**
  (``*.key`` files written by ``oakemu keygen``; the folder is read again when it changes):

  - ``actors/*.key``: the ``actor`` role: the data, control and weights sockets (join, steps, weights);
  - ``monitors/*.key``: the ``monitor`` role: the telemetry socket only (a monitor key cannot join);
  - ``*.key`` in the folder itself: both roles (the layout before roles existed; the learner warns).

  A refused client never completes the handshake: it cannot join, send steps or receive weights or
  telemetry. Refusals are counted. Actors and monitors load their own key pair and the learner's
  public key the same way.
* **Peer binding** (always on): an actor id is bound at join to the connection it joined from, while
  the actor is connected: the control connection's ZeroMQ routing id (:func:`new_routing_id`: a
  secret of the actor process, kept when it remakes its socket), the peer's address and, with CURVE,
  its public key. A join for that id, or a heartbeat or leave, from any other connection is refused
  and counted (``impersonation``), whatever incarnation it names. A connection whose routing id
  ZeroMQ generated (:func:`is_generated_routing_id`) speaks for no actor (``anonymous_connection``).
  Step messages (a PUSH socket has no routing id) are bound to the join's address and key, and name
  the incarnation: a secret the
  actor makes, never published (telemetry shows :func:`public_tag` of it) nor logged while it is live.

Key files are ZeroMQ's own certificate format (``zmq.auth.create_certificates``):
``NAME.key`` (public) and ``NAME.key_secret`` (public + secret, mode 0600).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import secrets
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from oakemu_core.errors import UserError

__all__ = [
    "ROLES",
    "ZAP_DOMAINS",
    "ClientSecurity",
    "Connection",
    "PeerBinding",
    "ServerSecurity",
    "TransportSecurityError",
    "client_security",
    "generate_keypair",
    "is_generated_routing_id",
    "is_loopback",
    "new_routing_id",
    "peer_of",
    "public_tag",
    "server_security",
]

log = logging.getLogger("oakemu.auth")

ROLES = ("actor", "monitor")
"""What a client key may do: ``actor`` (data, control and weights sockets), ``monitor`` (telemetry)."""
ROLE_FOLDERS = {"actor": "actors", "monitor": "monitors"}
"""Sub-folder of ``curve_authorized_keys`` holding the keys of each role."""
ZAP_DOMAINS = {"actor": "oakemu.actor", "monitor": "oakemu.monitor"}
"""The ZAP domain of the learner's sockets of each role (the authenticator learns the role from it)."""
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
        raise TransportSecurityError(
            f"{public} or {secret} exists already (choose another name or --force)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(
        0o077
    )  # the secret file is never readable by others, not even for a moment
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
        raise TransportSecurityError(
            f"{path} holds no secret key: give the NAME{SECRET_SUFFIX} file of `oakemu keygen`"
        )
    return public, secret


def load_public_key(path: Path) -> bytes:
    """The z85 public key in a ``NAME.key`` (or ``NAME.key_secret``) file."""
    return _load(path, "public key")[0]


def _load(path: Path, what: str) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise TransportSecurityError(
            f"{what} file {path} does not exist (make one with `oakemu keygen`)"
        )
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
    """The authorised public keys and their roles (see the module docstring), re-read when a folder changes.

    Called by the ZAP authenticator's thread for every new connection; counts refusals and logs them
    through ``refusal_log`` (``event(reason, text)``, rate limited: a client can retry at will).
    """

    def __init__(self, folder: Path, refusal_log: Any = None) -> None:
        self.folder = folder
        self.lock = threading.Lock()
        self.keys: dict[bytes, frozenset[str]] = {}
        self.stamp: tuple[tuple[float, int] | None, ...] | None = None
        self.refused = 0
        self.accepted = 0
        self.refusal_log = refusal_log
        self.reload()

    def _folders(self) -> list[tuple[Path, frozenset[str]]]:
        """Each folder read, with the roles its keys get."""
        return [
            (self.folder, frozenset(ROLES)),
            *((self.folder / sub, frozenset({role})) for role, sub in ROLE_FOLDERS.items()),
        ]

    def _stamp(self) -> tuple[tuple[float, int] | None, ...]:
        stamps = []
        for folder, _ in self._folders():
            try:
                stat = folder.stat()
                stamps.append((stat.st_mtime, stat.st_size))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def reload(self) -> None:
        """Read every ``*.key`` file of the folders (a file that is not a key file is skipped with a warning)."""
        stamp = self._stamp()
        keys: dict[bytes, frozenset[str]] = {}
        for folder, roles in self._folders():
            for path in sorted(folder.glob(f"*{PUBLIC_SUFFIX}")) if folder.is_dir() else ():
                try:
                    key = load_public_key(path)
                except TransportSecurityError as error:
                    log.warning("ignored in the authorised keys: %s", error)
                    continue
                keys[key] = keys.get(key, frozenset()) | roles
        with self.lock:
            self.keys = keys
            self.stamp = stamp

    def count(self, role: str) -> int:
        """Keys authorised for ``role``."""
        with self.lock:
            return sum(role in roles for roles in self.keys.values())

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: allow ``key`` (z85) when it is authorised for the role of ``domain``; count the refusal otherwise."""
        if self._stamp() != self.stamp:
            self.reload()  # a folder that vanished authorises nothing from now on
        role = next((r for r, d in ZAP_DOMAINS.items() if d == domain), None)
        with self.lock:
            allowed = role in self.keys.get(key, ())
            if allowed:
                self.accepted += 1
                return True
            self.refused += 1
            detail = (
                f"unauthorized_key: a client whose CURVE key ({key[:8].decode(errors='replace')}...) is not "
                f"authorised for the {role} role"
            )
            if self.refusal_log is not None:
                self.refusal_log.event("unauthorized_key", detail)
            else:
                log.warning("%s", detail)
        return False

    def flush_log(self) -> None:
        """Write the summary of the refusals logged since the last line, if one is due (any thread)."""
        if self.refusal_log is not None:
            with self.lock:
                self.refusal_log.flush()


@dataclass
class ServerSecurity:
    """CURVE server keys plus the running ZAP authenticator; ``apply`` to every bound socket."""

    public_key: bytes
    secret_key: bytes
    authorized: _AuthorizedKeys
    authenticator: Any  # zmq.auth.thread.ThreadAuthenticator

    def apply(self, sock: zmq.Socket, role: str = "actor") -> zmq.Socket:
        """Make ``sock`` a CURVE server for the clients of ``role`` (one of :data:`ROLES`; before it binds)."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAINS[role].encode()
        return sock

    def for_role(self, role: str) -> _RoleSecurity:
        """An object whose ``apply(sock)`` makes a CURVE server for ``role`` (for code that takes a
        ``security`` with ``apply``, e.g. the telemetry publisher)."""
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, received {role!r}")
        return _RoleSecurity(self, role)

    @property
    def refused(self) -> int:
        """Connections refused because the client's key is not authorised (for the socket's role)."""
        return self.authorized.refused

    def flush_log(self) -> None:
        """Write the summary of the refusals not logged yet, if one is due (the ``refusal_log``'s ``flush``)."""
        self.authorized.flush_log()

    def close(self) -> None:
        """Stop the authenticator thread (idempotent)."""
        if self.authenticator.is_alive():
            self.authenticator.stop()


@dataclass(frozen=True)
class _RoleSecurity:
    """:meth:`ServerSecurity.for_role`: ``apply`` for one role."""

    security: ServerSecurity
    role: str

    def apply(self, sock: zmq.Socket) -> zmq.Socket:
        return self.security.apply(sock, self.role)


def server_security(
    context: zmq.Context, config: Any, refusal_log: Any = None
) -> ServerSecurity | None:
    """The learner's CURVE setup from ``config`` (``curve``, ``curve_secret_key``, ``curve_authorized_keys``).

    None when ``curve`` is off (with a warning when the learner binds a non-loopback address).
    ``refusal_log``: logs each refused connection, ``event(reason, text)`` and ``flush()``, from the
    authenticator's thread (rate limited); None logs every refusal.

    Raises:
        TransportSecurityError: CURVE is on but a key file or the authorised-keys folder is missing.
    """
    if not config.curve:
        if not is_loopback(config.bind_host):
            log.warning(
                "the learner's ports on %s accept any client: set curve = true (OAKEMU_CURVE) with keys "
                "from `oakemu keygen` unless this network is private (deploy/README.md)",
                config.bind_host,
            )
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
    authorized = _AuthorizedKeys(folder, refusal_log)
    if not authorized.keys:
        log.warning(
            "no authorised client keys in %s yet: every actor and monitor is refused until one is added",
            folder,
        )
    both = len(list(folder.glob(f"*{PUBLIC_SUFFIX}")))
    if both:
        log.warning(
            "%d key(s) in %s itself may join as actors and read telemetry: move actor keys to %s/ and "
            "monitor keys to %s/ (a monitor key then cannot join; deploy/README.md)",
            both,
            folder,
            folder / ROLE_FOLDERS["actor"],
            folder / ROLE_FOLDERS["monitor"],
        )
    from zmq.auth.thread import (
        ThreadAuthenticator,
    )  # imported only when CURVE is on (pulls in asyncio)

    authenticator = ThreadAuthenticator(context, log=logging.getLogger("oakemu.auth.zap"))
    authenticator.start()
    for domain in ZAP_DOMAINS.values():
        authenticator.configure_curve_callback(domain, credentials_provider=authorized)
    log.info(
        "CURVE on: %d actor and %d monitor keys authorised in %s",
        authorized.count("actor"),
        authorized.count("monitor"),
        folder,
    )
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


def is_generated_routing_id(routing_id: bytes) -> bool:
    """Whether a ROUTER's routing id was generated by ZeroMQ (empty or first byte zero): the client set
    none, or the id was moved off an earlier connection of a client that reconnected
    (``ROUTER_HANDOVER``), whose unread requests then arrive under it. Such a connection speaks for no
    actor (:func:`new_routing_id` ids never start with zero)."""
    return not routing_id or routing_id[0] == 0


def new_routing_id() -> bytes:
    """A ZeroMQ routing id for an actor's control socket: 16 random bytes, the first never zero
    (ZeroMQ reserves those). The actor keeps it for its process's life, also when it remakes the
    socket, and shows it to nobody: the learner binds the actor id to it (:class:`PeerBinding`)."""
    routing_id = bytearray(secrets.token_bytes(16))
    routing_id[0] |= 1
    return bytes(routing_id)


@dataclass(frozen=True)
class Connection:
    """Who sent a control request: the ROUTER's routing id of its connection, its address and its
    CURVE user id (its public key, z85; ``""`` without CURVE). Made by :meth:`PeerBinding.connection`."""

    routing_id: bytes
    address: str
    user_id: str


@dataclass
class PeerBinding:
    """Binds each actor id to the connection it joined from and refuses its messages from any other.

    ``bind`` at join (:class:`Connection`), ``allows_control`` for every heartbeat and leave, ``allows``
    for every step message (a received frame: address and CURVE key of the join, see the module
    docstring). A join for an actor id bound to another connection is refused while the binding is live
    (``forget`` it when the actor leaves, ``retain`` the connected ones). ``user_ids``: whether peers
    carry CURVE user ids (the learner's sockets are CURVE servers); False skips looking them up.
    """

    peers: dict[str, tuple[str, Connection]] = field(default_factory=dict)
    refused: Counter = field(default_factory=Counter)
    user_ids: bool = True

    def connection(self, routing_id: Any, frame: Any) -> Connection:
        """The :class:`Connection` of a control request: the ROUTER's routing id frame (or bytes) and
        a frame of the request (for the address and CURVE user id)."""
        address, user = peer_of(frame, user_id=self.user_ids)
        return Connection(
            routing_id.bytes if isinstance(routing_id, zmq.Frame) else bytes(routing_id),
            address,
            user,
        )

    def bind(self, actor_id: str, incarnation: str, connection: Connection) -> bool:
        """Record the join's connection; False (refused, counted) when ``actor_id`` is bound to another."""
        bound = self.peers.get(actor_id)
        if bound is not None and bound[1] != connection:
            self.refused["impersonation"] += 1
            return False
        self.peers[actor_id] = (incarnation, connection)
        return True

    def allows_control(self, actor_id: str, incarnation: str, connection: Connection) -> bool:
        """True when a heartbeat or leave comes from the connection ``actor_id`` joined from (an old
        incarnation's late request is the assembler's business), or the actor is not bound."""
        bound = self.peers.get(actor_id)
        if bound is None or bound[1] == connection:
            return True
        self.refused["impersonation"] += 1
        return False

    def allows(self, actor_id: str, incarnation: str, frame: Any) -> bool:
        """True when a step message (a received frame) comes from the address and CURVE key
        ``actor_id`` joined from, or the actor is not bound (the assembler decides about unknown actors)."""
        bound = self.peers.get(actor_id)
        if bound is None:
            return True
        if peer_of(frame, user_id=self.user_ids) == (bound[1].address, bound[1].user_id):
            return True
        self.refused["impersonation"] += 1
        return False

    def forget(self, actor_id: str) -> None:
        """Drop the binding (the actor left or was dropped)."""
        self.peers.pop(actor_id, None)

    def retain(self, live_actor_ids: Any) -> None:
        """Forget every actor not in ``live_actor_ids`` (those the assembler still knows)."""
        for actor_id in [a for a in self.peers if a not in live_actor_ids]:
            del self.peers[actor_id]
