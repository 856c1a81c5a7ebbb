"""Actor <-> learner transport, one module per concept.

- :mod:`~oakemu_core.transport.codec`: msgpack framing, wire arrays, limits, :class:`MessageRejected`.
- :mod:`~oakemu_core.transport.control`: join, heartbeat, leave, weights and stop messages.
- :mod:`~oakemu_core.transport.steps`: step messages and the :class:`StepSpec` they are checked against.
- :mod:`~oakemu_core.transport.batching`: how many vector steps one message carries.
- :mod:`~oakemu_core.transport.step_blocks`: an actor's block of K vector steps.
- :mod:`~oakemu_core.transport.step_ring`: step arrays in shared memory, for actors on the learner's machine.
- :mod:`~oakemu_core.transport.channels`: one step channel per side (socket or ring), behind one interface.
- :mod:`~oakemu_core.transport.auth`: CURVE keys and the binding of actors to their peers.
"""
