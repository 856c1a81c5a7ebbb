"""What surrounds a run: checkpoints, the run folder, metrics, telemetry, the tester and evaluation."""
