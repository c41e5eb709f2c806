"""A seeded network fuzzer in Python: a pyarrow Flight client (over the cluster's TLS) sends
actions of every known type and random ones with random and mutated bodies, random tickets
and puts with random commands, with the token, with a wrong one and with none. Every call
must end with a status within its deadline, calls without the right token must all be
refused, and the workers must stay up and keep working.

``FLIGHTSHUFFLE_NET_FUZZ_CASES`` sets the calls per kind (default 150) and
``FLIGHTSHUFFLE_NET_FUZZ_SEED`` the seed."""

from __future__ import annotations

import os
import random
import socket
import time

import flightshuffle as fs
import pyarrow as pa
import pytest
from pyarrow import flight

ACTIONS = [
    "create_shuffle",
    "run_map",
    "run_reduce",
    "fold",
    "seal_shuffle",
    "drop_shuffle",
    "commit",
    "cancel",
    "merge",
    "stats",
    "health",
]
CASES = int(os.environ.get("FLIGHTSHUFFLE_NET_FUZZ_CASES", "150"))
SEED = int(os.environ.get("FLIGHTSHUFFLE_NET_FUZZ_SEED", "11"))


def _bytes(rng: random.Random) -> bytes:
    shape = rng.randrange(4)
    if shape == 0:
        return b""
    if shape == 1:  # a protobuf-looking prefix: field 1, varint
        return bytes([0x08, rng.randrange(256), 0x10, rng.randrange(256)]) + rng.randbytes(
            rng.randrange(16)
        )
    return rng.randbytes(rng.randrange(1, 256))


def test_random_calls_get_statuses_and_the_workers_stay_up():
    rng = random.Random(SEED)
    with fs.Cluster(workers=2, timeout=30) as c:
        info = c.connection_info()
        pids = c.worker_pids
        client = flight.FlightClient(
            f"grpc+tls://{info['addresses'][0]}", tls_root_certs=info["ca"]
        )
        tokens = {
            "right": [(b"authorization", f"Bearer {info['token']}".encode())],
            "wrong": [(b"authorization", b"Bearer " + rng.randbytes(16).hex().encode())],
            "none": [],
        }
        outcomes: dict[str, int] = {}
        for case in range(CASES * 3):
            who = ("right", "wrong", "none")[case % 3]
            options = flight.FlightCallOptions(headers=tokens[who], timeout=10)
            kind = rng.randrange(3)
            start = time.monotonic()
            try:
                if kind == 0:
                    name = rng.choice(ACTIONS) if rng.random() < 0.8 else rng.randbytes(6).hex()
                    list(client.do_action(flight.Action(name, _bytes(rng)), options=options))
                elif kind == 1:
                    client.do_get(flight.Ticket(_bytes(rng)), options=options).read_all()
                else:
                    table = pa.table({"k": list(range(rng.randrange(1, 100)))})
                    descriptor = flight.FlightDescriptor.for_command(_bytes(rng))
                    writer, _ = client.do_put(descriptor, table.schema, options=options)
                    writer.write_table(table)
                    writer.close()
                outcome = f"{who}: ok"
            except flight.FlightUnauthenticatedError:
                outcome = f"{who}: unauthenticated"
            except (flight.FlightError, pa.ArrowException) as e:
                outcome = f"{who}: {type(e).__name__}"
            assert time.monotonic() - start < 12, f"case {case} past its deadline"
            assert who == "right" or outcome.endswith("unauthenticated"), (case, outcome)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        client.close()
        print(outcomes)
        # The same processes, healthy, and a real job still works.
        assert c.worker_pids == pids
        assert c.recovery()["replacements"] == 0
        got = pa.concat_tables(c.shuffle(pa.table({"k": list(range(500))}), by="k", partitions=3))
        assert sorted(got["k"].to_pylist()) == list(range(500))


@pytest.mark.parametrize("scheme", ["grpc", "grpc+tls"])
def test_clients_that_cannot_verify_the_workers_are_refused(scheme):
    with fs.Cluster(workers=1) as c:
        info = c.connection_info()
        client = flight.FlightClient(f"{scheme}://{info['addresses'][0]}")
        options = flight.FlightCallOptions(
            headers=[(b"authorization", f"Bearer {info['token']}".encode())], timeout=10
        )
        with pytest.raises(flight.FlightError):
            list(client.do_action(flight.Action("health", b""), options=options))


def test_connections_that_never_finish_their_tls_handshake_are_cut_off_and_the_worker_goes_on():
    """Clients that open a TCP connection to a TLS worker and send nothing are closed by the
    worker after its handshake timeout (10 s), not held open forever; meanwhile and after, the
    worker serves. Before: the connections stayed open (the reads below timed out)."""
    with fs.Cluster(workers=1, timeout=30) as c:
        info = c.connection_info()
        host, port = info["addresses"][0].rsplit(":", 1)
        silent = [socket.create_connection((host, int(port))) for _ in range(3)]
        client = flight.FlightClient(
            f"grpc+tls://{info['addresses'][0]}", tls_root_certs=info["ca"]
        )
        options = flight.FlightCallOptions(
            headers=[(b"authorization", f"Bearer {info['token']}".encode())], timeout=10
        )
        assert list(client.do_action(flight.Action("health", b""), options=options))
        start = time.monotonic()
        for s in silent:
            s.settimeout(30)
            assert s.recv(1) == b"", "the worker sent bytes to a client that said nothing"
            s.close()
        assert time.monotonic() - start < 20
        assert list(client.do_action(flight.Action("health", b""), options=options))
