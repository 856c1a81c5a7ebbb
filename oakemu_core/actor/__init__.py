"""The actor side: stepping vector envs with the policy, per-step buffers, action routing."""
