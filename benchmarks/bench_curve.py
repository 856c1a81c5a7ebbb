"""What ZeroMQ CURVE costs per step message: CPU time of PUSH -> PULL over TCP loopback, plain vs CURVE.

The end-to-end figure (``bench_pipeline.py --curve``) moves with whatever else the machine does; this
one counts CPU seconds of the sending and receiving sockets (one process: ``time.process_time``
covers ZeroMQ's I/O threads), so it holds on a busy machine too. Message sizes are those of one
actor step with 8 envs: Breakout (4 x 84 x 84 uint8 observations) and CartPole (4 float32).
The CURVE side runs the learner's own setup (``oakemu_core.transport.auth``: ZAP authenticator, authorised
keys folder).

Usage: ``python benchmarks/bench_curve.py [--messages 2000] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from oakemu_core.transport.auth import client_security, generate_keypair, server_security  # noqa: E402

SIZES = {"Breakout, 8 envs": 8 * (4 * 84 * 84 + 40), "CartPole, 8 envs": 8 * (4 * 4 + 40)}


def measure(message_bytes: int, messages: int, keys: Path | None) -> tuple[float, float]:
    """(CPU seconds, wall seconds) to send and receive ``messages`` messages of ``message_bytes``."""
    context = zmq.Context()
    server = client = None
    if keys is not None:
        server = server_security(
            context,
            SimpleNamespace(
                curve=True,
                bind_host="127.0.0.1",
                curve_secret_key=keys / "learner.key_secret",
                curve_authorized_keys=keys / "authorized",
            ),
        )
        client = client_security(
            SimpleNamespace(
                curve=True,
                curve_secret_key=keys / "authorized" / "actor.key_secret",
                curve_server_key=keys / "learner.key",
            )
        )
    try:
        pull = context.socket(zmq.PULL)
        push = context.socket(zmq.PUSH)
        if server is not None and client is not None:
            server.apply(pull)
            client.apply(push)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        payload = bytes(message_bytes)
        push.send(payload)  # handshake outside the measurement
        pull.recv()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(messages):
            push.send(payload, copy=False)
            pull.recv(copy=False)
        return time.process_time() - cpu, time.perf_counter() - wall
    finally:
        if server is not None:
            server.close()
        context.destroy(linger=0)


def main() -> None:
    """Print CPU microseconds per message, plain and CURVE, and the ratio (medians of interleaved repeats)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder)
        generate_keypair(keys, "learner")
        generate_keypair(keys / "authorized", "actor")
        print(f"{args.messages} messages per figure, median of {args.repeats} interleaved repeats")
        print(
            f"{'message':<20}{'bytes':>9}{'plain us/msg':>14}{'CURVE us/msg':>14}{'extra us':>10}{'CPU x':>7}"
            f"{'plain MB/s':>12}{'CURVE MB/s':>12}"
        )
        for name, size in SIZES.items():
            plain, curve = [], []
            for _ in range(args.repeats):
                plain.append(measure(size, args.messages, None))
                curve.append(measure(size, args.messages, keys))
            plain_cpu = statistics.median(c for c, _ in plain) / args.messages * 1e6
            curve_cpu = statistics.median(c for c, _ in curve) / args.messages * 1e6
            plain_rate = size * args.messages / statistics.median(w for _, w in plain) / 1e6
            curve_rate = size * args.messages / statistics.median(w for _, w in curve) / 1e6
            print(
                f"{name:<20}{size:>9}{plain_cpu:>14.1f}{curve_cpu:>14.1f}{curve_cpu - plain_cpu:>10.1f}"
                f"{curve_cpu / plain_cpu:>7.2f}{plain_rate:>12.0f}{curve_rate:>12.0f}"
            )


if __name__ == "__main__":
    main()
