"""The transport's settings, declared once: :class:`oakemu_core.config.OakEmuConfig` inherits them
(command-line flags, ``OAKEMU_*`` variables and TOML keys like every other setting).

:class:`TransportSettings`: how actors hand their steps to the learner, the addresses and ports of
the learner's sockets, and the message limits. :class:`SecuritySettings`: ZeroMQ CURVE and what the
learner takes from its peers (the trust model: deploy/README.md). This module imports neither torch
nor numpy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["PORT_FIELDS", "SecuritySettings", "TransportSettings", "check_ports_differ"]

PORT_FIELDS = ("data_port", "control_port", "weights_port", "telemetry_port", "metrics_port")
"""The settings naming a port the learner listens on (each distinct)."""


class TransportSettings(BaseModel):
    """How steps travel, where the learner listens and what one message may hold (one line each;
    :class:`~oakemu_core.config.OakEmuConfig` checks that the ports differ with
    :func:`check_ports_differ`, after its other checks)."""

    model_config = ConfigDict(extra="forbid")

    step_transport: Literal["auto", "sockets"] = Field(
        "auto",
        description="How actors hand their step arrays to the learner: auto (a shared-memory step ring when they "
        "share a machine and /dev/shm, inline in the ZeroMQ messages otherwise), or sockets (always inline).",
    )

    # --- network addresses ---
    bind_host: str = Field(
        "127.0.0.1", min_length=1, description="Address the learner binds its sockets to."
    )
    learner_host: str = Field(
        "127.0.0.1", min_length=1, description="Where actors and monitors find the learner."
    )
    data_port: int = Field(5555, ge=1, le=65535, description="Learner PULL port for step messages.")
    control_port: int = Field(
        5556, ge=1, le=65535, description="Learner ROUTER port for join/heartbeat/leave."
    )
    weights_port: int = Field(5557, ge=1, le=65535, description="Learner PUB port for weights.")
    telemetry_port: int = Field(
        5558, ge=1, le=65535, description="Learner PUB port for telemetry snapshots."
    )
    metrics_port: int | None = Field(
        9100, ge=0, le=65535, description="Prometheus HTTP port (None or 0 disables)."
    )
    actor_timeout_s: float = Field(
        10.0, gt=0.0, description="Drop an actor silent for this many seconds."
    )
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest accepted message (bytes)."
    )

    @property
    def metrics_enabled(self) -> bool:
        """True when the Prometheus endpoint should be served (``metrics_port`` not None/0)."""
        return bool(self.metrics_port)

    def learner_address(self, port: int) -> str:
        """ZeroMQ address ``tcp://learner_host:port`` actors and monitors connect to."""
        return f"tcp://{_host_for_url(self.learner_host)}:{port}"

    def bind_address(self, port: int) -> str:
        """ZeroMQ address ``tcp://bind_host:port`` the learner binds."""
        return f"tcp://{_host_for_url(self.bind_host)}:{port}"


class SecuritySettings(BaseModel):
    """ZeroMQ CURVE keys, and the learner's limits on what its peers ask and send (one line each;
    validated when built: ``reward_low`` / ``reward_high`` both set, in order, or neither)."""

    model_config = ConfigDict(extra="forbid")

    # --- transport security (ZeroMQ CURVE, see deploy/README.md) ---
    curve: bool = Field(
        False,
        description="Encrypt and authenticate every learner socket with ZeroMQ CURVE (off by default: "
        "turn it on whenever the learner's ports are reachable from other machines).",
    )
    curve_secret_key: Path | None = Field(
        None,
        description="This process's CURVE key pair file (NAME.key_secret from `oakemu keygen`).",
    )
    curve_server_key: Path | None = Field(
        None,
        description="Actors and monitors: the learner's public key file (learner.key from `oakemu keygen`).",
    )
    curve_authorized_keys: Path | None = Field(
        None,
        description="Learner: folder of the public key files (*.key) of the actors and monitors it accepts.",
    )

    # --- what the learner takes from its peers (the trust model: deploy/README.md) ---
    max_envs_per_actor: int = Field(
        1024,
        ge=1,
        le=65536,
        description="Learner: refuse a join asking for more envs than this (never below "
        "envs_per_actor).",
    )
    max_connected_actors: int = Field(
        1024,
        ge=1,
        description="Learner: refuse joins of further actor ids while this many actors are connected.",
    )
    reward_low: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Learner: lowest raw reward one env step can give (None: not "
        "declared). With reward_high, step messages whose rewards, value estimates or episode returns no env "
        "of the run can give are refused.",
    )
    reward_high: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Learner: highest raw reward one env step can give (see reward_low).",
    )
    step_ring_max_mib: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="Learner: shared memory (MiB) its step rings take together "
        "(None: a quarter of /dev/shm; at most what /dev/shm holds beside the rollout buffers); an actor whose "
        "ring finds no room sends its step arrays inline.",
    )
    step_ring_max_mib_per_actor: float = Field(
        128.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Learner: largest step ring (MiB) of one actor; a larger "
        "one is not made (its step arrays go inline).",
    )
    metrics_host: str | None = Field(
        None, min_length=1, description="Address the Prometheus endpoint binds (None: bind_host)."
    )

    @model_validator(mode="after")
    def _check_reward_range(self) -> SecuritySettings:
        if (self.reward_low is None) != (self.reward_high is None) or (
            self.reward_low is not None and self.reward_low > self.reward_high
        ):
            raise ValueError(
                f"reward_low / reward_high: expected both unset or reward_low <= reward_high, "
                f"received {self.reward_low} and {self.reward_high}"
            )
        return self


def check_ports_differ(settings: TransportSettings) -> None:
    """Raise ValueError naming the first of :data:`PORT_FIELDS` whose port another one uses (a port
    of 0 or None binds nothing and is never compared)."""
    used: dict[int, str] = {}
    for name in PORT_FIELDS:
        port = getattr(settings, name)
        if port and port in used:
            raise ValueError(
                f"{name}: expected a port different from {used[port]}={port}, received {port}"
            )
        used[port] = name


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
