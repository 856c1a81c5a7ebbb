"""The fields of one run's steps: :class:`StepSchema`, the ordered, named set of
:class:`~oakemu_core.step_schema.fields.StepField` that storage, the wire, the actors' step buffers,
minibatches and checkpoints are derived from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from oakemu_core.step_schema.fields import (
    OBSERVATION_FIELD,
    StepField,
    check_array,
    policy_revisions_field,
)

if TYPE_CHECKING:  # torch is imported lazily: the schema, buffers and wire stay torch-free
    from oakemu_core.policy.distributions import ActionDistribution


@dataclass(frozen=True, eq=False)
class StepSchema:
    """An ordered set of :class:`StepField` s, plus the action distribution they were built for.

    Args:
        fields: the fields, names unique.
        distribution: the policy's action distribution (None for a schema declared by hand,
            e.g. the plain constructor ``RolloutBuffer(T, N, shape, dtype)``).

    Raises:
        ValueError: duplicate names, or a required standard field missing.
    """

    fields: tuple[StepField, ...]
    distribution: ActionDistribution | None = None
    _by_name: dict[str, StepField] = field(init=False, repr=False, compare=False)

    REQUIRED = (
        "actions",
        "log_probs",
        "values",
        "rewards",
        "dones",
        "truncated",
        "bootstrap_values",
        "next_values",
        "trainable",
        "policy_versions",
        "policy_revisions",
        "advantages",
        "returns",
    )

    def __post_init__(self) -> None:
        fields = tuple(self.fields)
        object.__setattr__(self, "fields", fields)
        by_name: dict[str, StepField] = {}
        for item in fields:
            if item.name in by_name:
                raise ValueError(f"schema: field {item.name!r} declared twice")
            by_name[item.name] = item
        missing = [name for name in self.REQUIRED if name not in by_name]
        if missing or not self.observation_names:
            raise ValueError(f"schema: missing standard fields {missing or ['observations']}")
        object.__setattr__(self, "_by_name", by_name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepSchema) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self.to_dict()))

    def __getitem__(self, name: str) -> StepField:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @cached_property  # fields never change: computed once (the ingest path asks per message)
    def sent(self) -> tuple[StepField, ...]:
        """Fields in every step message, in declaration order."""
        return tuple(f for f in self.fields if f.sent)

    @cached_property
    def stored(self) -> tuple[StepField, ...]:
        """Fields the rollout buffer allocates."""
        return tuple(f for f in self.fields if f.stored)

    @cached_property
    def minibatch(self) -> tuple[StepField, ...]:
        """Fields PPO minibatches carry."""
        return tuple(f for f in self.fields if f.minibatch)

    @cached_property
    def action_fields(self) -> tuple[StepField, ...]:
        """Fields the action distribution reads back in the update: ``actions``, its stored
        parameters (``action_mean``, ``action_std``) and ``action_mask``."""
        names = {"actions", "action_mask"}
        if self.distribution is not None:
            names.update(self.distribution.stored_fields())
        return tuple(f for f in self.fields if f.name in names)

    @cached_property
    def observation_names(self) -> tuple[str, ...]:
        """Observation fields: ``("observations",)`` or ``("observations.<key>", ...)``."""
        return tuple(
            f.name
            for f in self.fields
            if f.name == OBSERVATION_FIELD or f.name.startswith(OBSERVATION_FIELD + ".")
        )

    @cached_property
    def is_dict_observation(self) -> bool:
        return self.observation_names != (OBSERVATION_FIELD,)

    def observation_key(self, name: str) -> str:
        """The observation key of an observation field (``""`` for the plain one)."""
        return "" if name == OBSERVATION_FIELD else name[len(OBSERVATION_FIELD) + 1 :]

    # -- observations as the env and the model see them -----------------------------------------
    def split_observations(self, observations: Any) -> dict[str, Any]:
        """``{field name: array}`` from an env's observations (an array, or a dict keyed by key)."""
        if not self.is_dict_observation:
            return {OBSERVATION_FIELD: observations}
        if not isinstance(observations, Mapping):
            raise ValueError(
                f"observations: expected a dict with keys "
                f"{[self.observation_key(n) for n in self.observation_names]}, "
                f"received {type(observations).__name__}"
            )
        missing = [
            self.observation_key(n)
            for n in self.observation_names
            if self.observation_key(n) not in observations
        ]
        if missing:
            raise ValueError(
                f"observations: missing keys {missing}, received keys {sorted(observations)}"
            )
        return {name: observations[self.observation_key(name)] for name in self.observation_names}

    def join_observations(self, fields: Mapping[str, Any]) -> Any:
        """Inverse of :meth:`split_observations`: one array, or a dict keyed by observation key."""
        if not self.is_dict_observation:
            return fields[OBSERVATION_FIELD]
        return {self.observation_key(name): fields[name] for name in self.observation_names}

    # -- validation of local writes ---------------------------------------------------------------
    def check_arrays(
        self, arrays: Mapping[str, Any], count: int, fields: Iterable[StepField]
    ) -> None:
        """Check that each of ``fields`` is in ``arrays`` with shape ``(count, *shape)`` and the exact dtype.

        Raises:
            ValueError: a field missing (with no default) or of the wrong type, shape or dtype,
                or an array that is not a field of this schema; the message names the field.
        """
        fields = tuple(fields)
        known = {f.name for f in fields}
        unknown = sorted(set(arrays) - known)
        if unknown:
            raise ValueError(f"unknown fields {unknown}; this schema has {sorted(known)}")
        for item in fields:
            array = arrays.get(item.name)
            if array is None:
                if item.default is None:
                    raise ValueError(f"{item.name}: required field missing")
                continue
            check_array(item.name, array, (count, *item.shape), item.dtype)

    # -- sizes --------------------------------------------------------------------------------------
    def stored_bytes_per_row(self) -> int:
        """Bytes one ``(t, env)`` row takes in the rollout buffer (every stored field)."""
        return sum(f.item_bytes for f in self.stored)

    def sent_bytes_per_env(self) -> int:
        """Array bytes one env contributes to a step message."""
        return sum(f.item_bytes for f in self.sent)

    # -- plain form ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain values for the join reply and checkpoints."""
        return {
            "fields": [f.to_dict() for f in self.fields],
            "distribution": None if self.distribution is None else self.distribution.to_dict(),
        }

    @classmethod
    def from_dict(
        cls,
        value: Any,
        distribution_from_dict: Callable[[dict[str, Any]], ActionDistribution] | None = None,
    ) -> StepSchema:
        """Inverse of :meth:`to_dict` for untrusted input.

        Args:
            value: a :meth:`to_dict` map.
            distribution_from_dict: parses its ``distribution`` map (the policy layer's
                :func:`~oakemu_core.policy.distributions.distribution_from_dict`;
                :func:`oakemu_core.policy.schemas.schema_from_dict` passes it); needed unless the
                distribution is None.

        Raises:
            ValueError: naming what is wrong, or a distribution map without ``distribution_from_dict``.
        """
        if not isinstance(value, dict) or value.keys() != {"fields", "distribution"}:
            raise ValueError("schema: expected a map with keys ['distribution', 'fields']")
        fields = value["fields"]
        if not isinstance(fields, list) or not 0 < len(fields) <= 256:
            raise ValueError("schema: fields must be a list of 1-256 field maps")
        distribution = value["distribution"]
        if distribution is not None:
            if not isinstance(distribution, dict):
                raise ValueError("schema: distribution must be a map or None")
            if distribution_from_dict is None:
                raise ValueError(
                    "schema: has an action distribution; parse it with "
                    "oakemu_core.policy.schemas.schema_from_dict"
                )
            distribution = distribution_from_dict(distribution)
        parsed = [StepField.from_dict(f) for f in fields]
        names = [f.name for f in parsed]
        if "policy_revisions" not in names and "policy_versions" in names:
            # A schema saved before rows carried the revision (checkpoints of earlier runs).
            parsed.insert(names.index("policy_versions") + 1, policy_revisions_field())
        return cls(tuple(parsed), distribution)

    def with_field(self, new: StepField) -> StepSchema:
        """A copy with one more field (e.g. a user's extra per-step data)."""
        return replace(self, fields=(*self.fields, new))

    def describe(self) -> str:
        """One line per field: name, shape, dtype, roles (for logs and error messages)."""
        lines = []
        for f in self.fields:
            roles = ",".join(r for r in ("sent", "stored", "minibatch") if getattr(f, r))
            lines.append(f"{f.name} {f.shape} {f.dtype} [{roles}]")
        return "; ".join(lines)
