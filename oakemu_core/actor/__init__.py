"""The actor side: stepping vector envs with the policy (stepper, per-step buffers, action routing),
the client of the learner's control and weights sockets, what a join builds, the weights an actor
acts with and its pacing. The process loop around them is ``oakemu_services.actor``."""
