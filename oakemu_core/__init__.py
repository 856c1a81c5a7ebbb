"""OakEmu-RL core library: rollout storage, GAE, PPO and the pieces the services wire together.

Only the rollout-core names are re-exported here; import other modules directly
(``from oakemu_core.algo.ppo import PPOLearner``). Importing this package does not import torch.
"""

from oakemu_core.actor.step_buffers import PPOActorStepBuffers
from oakemu_core.policy.action_bundle import PPOActionBundle
from oakemu_core.storage.rollout_buffer import RolloutBuffer, RolloutMinibatch

__all__ = ["PPOActionBundle", "PPOActorStepBuffers", "RolloutBuffer", "RolloutMinibatch"]
