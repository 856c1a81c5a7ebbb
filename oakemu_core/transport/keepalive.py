"""ZeroMQ connection heartbeats for an actor's sockets to the learner (control, weights, steps).

A TCP connection can go silent without closing (a stale NAT or connection-tracking entry, a learner
replaced behind one address); the socket would hold it until TCP gives up, about 15 minutes. With ZMTP
heartbeats (ZeroMQ 4.2+) the socket sends a PING when nothing else went out for
:data:`HEARTBEAT_IVL_MS` and closes a connection that answered nothing within
:data:`HEARTBEAT_TIMEOUT_MS`, then connects again. The learner's I/O thread answers the PINGs, however
busy its Python threads are.
"""

from __future__ import annotations

import zmq

__all__ = ["HEARTBEAT_IVL_MS", "HEARTBEAT_TIMEOUT_MS", "keep_alive"]

HEARTBEAT_IVL_MS = 1000
"""A connection heartbeat (ZMTP PING) when nothing else went out for this long (ms)."""
HEARTBEAT_TIMEOUT_MS = 5000
"""A connection that answers no PING within this (ms) is closed and made again; also sent as the TTL
after which the learner closes its end."""


def keep_alive(sock: zmq.Socket) -> None:
    """Turn on connection heartbeats (:data:`HEARTBEAT_IVL_MS`, :data:`HEARTBEAT_TIMEOUT_MS`) on a
    socket before it connects."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
