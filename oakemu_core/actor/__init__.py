"""The actor side, without sockets: stepping vector envs with the policy (stepper, per-step buffers,
action routing), the join client, what a join builds, the weights an actor acts with and its pacing."""
