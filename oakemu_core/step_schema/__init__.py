"""The one declaration of every per-step field: name, per-env shape, dtype, roles and value checks.

A :class:`StepSchema` is built once from the env's observation layout and the policy's
:class:`~oakemu_core.policy.distributions.ActionDistribution` (:func:`build_schema`), in the spirit of
Sample Factory's ``alloc_trajectory_tensors`` (spaces + one list of policy outputs) and TorchRL's
composite specs. Everything else is derived from it: the rollout buffer's shared-memory arrays
and their size (``/dev/shm`` check, ``shm_size`` advice), validation of writes, the wire encoding
of step messages and its value checks, the actor's step buffers, minibatch tensors, and the
checkpoint's metadata. Nothing else lists the fields.

Roles of a field:

* ``sent``: actors send it in every step message (validated at the wire, the trust boundary);
* ``stored``: the rollout buffer allocates it as ``(T, N, *shape)``;
* ``minibatch``: PPO minibatches carry it (flattened over the trainable rows).

The standard fields (``n`` envs; shapes per env):

==================  ============  =======  ====  ======  =====  =========================================
name                shape         dtype    sent  stored  mini   meaning
==================  ============  =======  ====  ======  =====  =========================================
observations[.key]  obs shape     obs      x     x       x      s_t (one field per dict key)
actions             action shape  action   x     x       x      a_t as sampled
log_probs           ()            f32      x     x       x      log pi(a_t | s_t) of the acting policy
values              ()            f32      x     x       x      V(s_t) of the acting policy
rewards             ()            f32      x     x              r_t
dones               ()            bool     x     x              the episode ended on step t
truncated           ()            bool     x                    ... by a time limit (implies dones)
bootstrap_values    ()            f32      x     x              V(true final obs) if truncated, else 0
next_values         ()            f32      x                    V(s_{t+1}): GAE's last value
trainable           ()            bool     x     x              the row may be trained on
action_mask         (mask width)  bool     x     x       x      allowed actions (masked envs only)
action_mean/_std    (d,)          f32      x     x       x      Gaussian parameters (Box actions only)
policy_state        (S,)          f32      x     x              recurrent policies: the state before s_t
policy_versions     ()            i64            x       x      version of the acting weights
policy_revisions    ()            i64            x              ... and their revision within it
advantages          ()            f32            x       x      GAE (written by compute_gae)
returns             ()            f32            x       x      advantages + values
==================  ============  =======  ====  ======  =====  =========================================
"""

from __future__ import annotations

from oakemu_core.step_schema.checks import (
    check_step_consistency,
    check_step_values,
    taken_action_allowed,
)
from oakemu_core.step_schema.fields import (
    MAX_ABS_STEP_VALUE,
    MAX_DIMENSIONS,
    OBSERVATION_FIELD,
    SMALL_ARRAY_SIZE,
    WIRE_DTYPES,
    StepField,
    check_array,
    observation_field_name,
)
from oakemu_core.step_schema.schema import StepSchema
from oakemu_core.step_schema.standard import build_schema, default_schema, resolve_schema

__all__ = [
    "MAX_ABS_STEP_VALUE",
    "MAX_DIMENSIONS",
    "OBSERVATION_FIELD",
    "SMALL_ARRAY_SIZE",
    "StepField",
    "StepSchema",
    "WIRE_DTYPES",
    "build_schema",
    "check_array",
    "check_step_consistency",
    "check_step_values",
    "default_schema",
    "observation_field_name",
    "resolve_schema",
    "taken_action_allowed",
]
