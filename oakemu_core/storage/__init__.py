"""The learner's rollout storage: the shared-memory rollout buffer (one checked write), the batches
PPO reads, GAE, memory checks, the assembler."""
