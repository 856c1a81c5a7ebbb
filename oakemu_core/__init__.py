"""OakEmu-RL core library: rollout storage, GAE, PPO and the pieces the services wire together.

Only the rollout-core names are re-exported here; import other modules directly
(``from oakemu_core.ppo import PPOLearner``). Importing this package does not import torch.
"""

from oakemu_core.actor_step_buffers import PPOActionBundle, PPOActorStepBuffers
from oakemu_core.rollout_buffer import RolloutBuffer, RolloutMinibatch

__all__ = ["PPOActionBundle", "PPOActorStepBuffers", "RolloutBuffer", "RolloutMinibatch"]
