"""The architecture of a policy network, declared once: :class:`NetworkSpec` and its settings.

An :class:`~oakemu_core.policy.models.ActorCritic` is ``encoders -> core -> torsos -> heads``:

* encoders: one per observation key (vectors flattened; pictures through the Nature CNN, the IMPALA
  ResNet or, below 36 x 36, a small CNN; or a user's encoder module), concatenated and mixed;
* core: none (feed-forward), or an LSTM / GRU of ``recurrent_hidden`` units carrying a state per env;
* torsos: the actor's and the critic's MLPs (``net_arch``, SB3's semantics), or one shared MLP;
* heads: the action distribution's and the value's linear layers.

The spec travels with everything that rebuilds a model: the learner's settings, the actors' join reply,
checkpoints (their settings), the exported policy folder (``policy.json``). ``to_dict`` / ``from_dict``
are its plain-value form. This module imports neither torch nor numpy (configuration parsing stays fast).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ACTIVATIONS",
    "CNNS",
    "RECURRENT_CORES",
    "NetworkSettings",
    "NetworkSpec",
    "parse_net_arch",
]

ACTIVATIONS = ("auto", "tanh", "relu", "elu", "gelu", "silu")
"""Activations of the MLP torsos (``auto``: tanh, as CleanRL's and SB3's MLP policies)."""
CNNS = ("nature", "impala")
"""Picture encoders: the Nature CNN of Mnih et al. 2015, or the IMPALA ResNet of Espeholt et al. 2018."""
RECURRENT_CORES = ("none", "lstm", "gru")
"""Recurrent cores between the encoders and the torsos (``none``: feed-forward)."""

_MODULE_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def parse_net_arch(text: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The actor's and the critic's hidden layer sizes written in ``text``, or None for ``auto``.

    Forms (SB3's ``net_arch``): ``"64,64"`` (both torsos 64-64, separate networks), ``"pi=64,64
    vf=256"`` (each its own; ``;`` or spaces between them), ``"none"`` or ``""`` (no hidden layer: the
    heads read the features).

    Raises:
        ValueError: anything else, naming the text and the expected forms.
    """
    text = text.strip().lower()
    if text == "auto":
        return None
    if text in ("", "none", "[]"):
        return (), ()

    def sizes(part: str) -> tuple[int, ...]:
        part = part.strip().strip("[]")
        if not part:
            return ()
        values = tuple(int(item) for item in part.split(","))
        if any(value <= 0 for value in values):
            raise ValueError
        return values

    try:
        if "=" not in text:
            layers = sizes(text)
            return layers, layers
        parts = dict(item.split("=", 1) for item in re.split(r"[;\s]+", text) if item)
        if not set(parts) <= {"pi", "vf"}:
            raise ValueError
        return sizes(parts.get("pi", "")), sizes(parts.get("vf", ""))
    except ValueError:
        raise ValueError(
            f"net_arch: expected 'auto', 'none', sizes like '64,64' or 'pi=64,64 vf=256', received {text!r}"
        ) from None


@dataclass(frozen=True)
class NetworkSpec:
    """The architecture of an actor-critic (see the module docstring); hashable, plain values.

    Attributes:
        net_arch: the torsos' hidden sizes (:func:`parse_net_arch`); ``auto``: 64-64 actor and critic
            MLPs over one vector observation (CleanRL, SB3; after its recurrent core too), none after a
            CNN, a dict's mixer or a user's encoder.
        activation: the torsos' activation (:data:`ACTIVATIONS`).
        shared_torso: one MLP (the actor's sizes) feeds both heads instead of one each.
        cnn: the encoder of pictures of at least 36 x 36 (:data:`CNNS`).
        impala_channels: the IMPALA ResNet's channels per stage.
        recurrent: the core (:data:`RECURRENT_CORES`).
        recurrent_hidden: the core's units.
        shared_core: one core feeds both torsos (CleanRL's ``ppo_atari_lstm.py``); False: the critic has
            a core of its own (sb3-contrib ``RecurrentPPO``'s default), and a state holds both, actor's first.
        ortho_init: CleanRL's orthogonal initialisation (gains sqrt(2), 0.01 for the policy head, 1 for
            the value); False: PyTorch's default initialisation of every layer (SB3's ``ortho_init=False``).
        policy_module: ``package.module:Class`` of a user's encoder (see
            :func:`oakemu_core.policy.encoders.user_encoder`), or None.
    """

    net_arch: str = "auto"
    activation: str = "auto"
    shared_torso: bool = False
    cnn: str = "nature"
    impala_channels: tuple[int, ...] = (16, 32, 32)
    recurrent: str = "none"
    recurrent_hidden: int = 128
    shared_core: bool = False
    ortho_init: bool = True
    policy_module: str | None = None

    def __post_init__(self) -> None:
        parse_net_arch(self.net_arch)
        for name, value, allowed in (
            ("activation", self.activation, ACTIVATIONS),
            ("cnn", self.cnn, CNNS),
            ("recurrent", self.recurrent, RECURRENT_CORES),
        ):
            if value not in allowed:
                raise ValueError(
                    f"{name}: expected one of {', '.join(allowed)}, received {value!r}"
                )
        if not self.impala_channels or any(
            isinstance(c, bool) or not isinstance(c, int) or c <= 0 for c in self.impala_channels
        ):
            raise ValueError(
                f"impala_channels: expected positive channel counts, received {self.impala_channels!r}"
            )
        if isinstance(self.recurrent_hidden, bool) or not (
            isinstance(self.recurrent_hidden, int) and self.recurrent_hidden > 0
        ):
            raise ValueError(
                f"recurrent_hidden: expected a positive int, received {self.recurrent_hidden!r}"
            )
        if self.policy_module is not None and not _MODULE_PATH.match(self.policy_module):
            raise ValueError(
                f"policy_module: expected 'package.module:Class', received {self.policy_module!r}"
            )

    @property
    def is_recurrent(self) -> bool:
        """The core carries a state per env."""
        return self.recurrent != "none"

    @property
    def state_size(self) -> int:
        """Floats of one env's recurrent state: per core ``2 * recurrent_hidden`` for an LSTM (h and c),
        ``recurrent_hidden`` for a GRU; two cores unless ``shared_core``; 0 without a core."""
        per_core = {"none": 0, "lstm": 2, "gru": 1}[self.recurrent] * self.recurrent_hidden
        return per_core if self.shared_core else 2 * per_core

    def torso_sizes(self, *, vector_observation: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The actor's and the critic's hidden sizes: ``net_arch`` resolved (``auto``: 64-64 each for
        one vector observation, none otherwise)."""
        parsed = parse_net_arch(self.net_arch)
        if parsed is not None:
            return parsed
        return ((64, 64), (64, 64)) if vector_observation else ((), ())

    def describe(self) -> str:
        """One line: what differs from the defaults (``default`` when nothing does)."""
        default = NetworkSpec()
        changed = [
            f"{name}={value}"
            for name, value in asdict(self).items()
            if value != getattr(default, name)
        ]
        return ", ".join(changed) or "default"

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON, msgpack, TOML-able but for None)."""
        value = asdict(self)
        value["impala_channels"] = list(self.impala_channels)
        return value

    @classmethod
    def from_dict(cls, value: Any) -> NetworkSpec:
        """Inverse of :meth:`to_dict` for untrusted input; missing keys take the defaults (a
        checkpoint or folder written before a field existed).

        Raises:
            ValueError: not a mapping, an unknown key, or a value out of range (naming it).
        """
        if not isinstance(value, Mapping):
            raise ValueError(f"network: expected a mapping, received {type(value).__name__}")
        names = {item.name for item in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"network: unknown keys {unknown}")
        values = dict(value)
        if "impala_channels" in values:
            channels = values["impala_channels"]
            if not isinstance(channels, (list, tuple)):
                raise ValueError(f"impala_channels: expected a list, received {channels!r}")
            values["impala_channels"] = tuple(channels)
        try:
            return cls(**values)
        except TypeError as error:
            raise ValueError(f"network: {error}") from None

    @classmethod
    def from_config(cls, config: Any) -> NetworkSpec:
        """The spec of ``config``'s settings (an :class:`~oakemu_core.config.OakEmuConfig`, a
        :class:`NetworkSettings`, a checkpoint's settings mapping, or anything with the same names);
        fields it lacks take the defaults."""

        def get(name: str) -> Any:
            if isinstance(config, Mapping):
                return config.get(name, _MISSING)
            return getattr(config, name, _MISSING)

        values = {item.name: get(item.name) for item in fields(cls)}
        values = {name: value for name, value in values.items() if value is not _MISSING}
        if isinstance(values.get("impala_channels"), str):
            values["impala_channels"] = _channels(values["impala_channels"])
        return cls.from_dict(values)


_MISSING = object()


def _channels(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(item) for item in text.split(","))
    except ValueError:
        raise ValueError(
            f"impala_channels: expected channel counts like '16,32,32', received {text!r}"
        ) from None


class NetworkSettings(BaseModel):
    """The policy network's settings (one line each): :class:`NetworkSpec`'s fields as options.

    Raises:
        pydantic.ValidationError (a ValueError): a value out of range, naming the field.
    """

    model_config = ConfigDict(extra="forbid")

    net_arch: str = Field(
        "auto",
        description="Actor/critic MLP sizes: '64,64' (each), 'pi=64,64 vf=256', 'none' "
        "(auto: 64,64 for one vector observation, none for pictures and dicts).",
    )
    activation: Literal["auto", "tanh", "relu", "elu", "gelu", "silu"] = Field(
        "auto", description="Activation of the MLP layers (auto: tanh)."
    )
    shared_torso: bool = Field(
        False, description="One MLP feeds both the policy and the value head (else one each)."
    )
    cnn: Literal["nature", "impala"] = Field(
        "nature",
        description="Encoder of pictures of at least 36x36: the Nature CNN or the IMPALA ResNet "
        "(smaller pictures get a small CNN).",
    )
    impala_channels: str = Field("16,32,32", description="Channels per stage of the IMPALA ResNet.")
    recurrent: Literal["none", "lstm", "gru"] = Field(
        "none", description="Recurrent core after the encoder: none (feed-forward), lstm or gru."
    )
    recurrent_hidden: int = Field(128, ge=1, le=65_536, description="Units of the recurrent core.")
    shared_core: bool = Field(
        False,
        description="One recurrent core feeds the policy and the value (CleanRL); else the value has its "
        "own (RecurrentPPO).",
    )
    ortho_init: bool = Field(
        True,
        description="Orthogonal initialisation (CleanRL, SB3's default); --no-ortho-init: PyTorch's default "
        "initialisation.",
    )
    policy_module: str | None = Field(
        None,
        description="package.module:Class of your own observation encoder (its contract: "
        "docs/spaces-and-policies.md, 'Your own encoder').",
    )

    @field_validator("net_arch")
    @classmethod
    def _check_net_arch(cls, value: str) -> str:
        try:
            parse_net_arch(value)
        except ValueError as error:  # pydantic names the field: the message does not repeat it
            raise ValueError(str(error).removeprefix("net_arch: ")) from None
        return value

    @field_validator("impala_channels")
    @classmethod
    def _check_channels(cls, value: str) -> str:
        try:
            channels = _channels(value)
        except ValueError as error:
            raise ValueError(str(error).removeprefix("impala_channels: ")) from None
        if not channels or min(channels) <= 0:
            raise ValueError(
                f"expected positive channel counts like '16,32,32', received {value!r}"
            )
        return value

    @field_validator("policy_module")
    @classmethod
    def _check_module(cls, value: str | None) -> str | None:
        if value is not None and not _MODULE_PATH.match(value):
            raise ValueError(f"expected 'package.module:Class', received {value!r}")
        return value

    @property
    def network(self) -> NetworkSpec:
        """These settings as a :class:`NetworkSpec`."""
        return NetworkSpec.from_config(self)
