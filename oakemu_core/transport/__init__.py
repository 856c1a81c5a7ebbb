"""Actor <-> learner messages: the msgpack codec, control and step messages, step rings, CURVE auth."""
