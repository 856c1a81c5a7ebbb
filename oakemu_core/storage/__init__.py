"""The learner's rollout storage: the shared-memory rollout buffer, GAE, memory checks, the assembler."""
