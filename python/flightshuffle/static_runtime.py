"""Workers at fixed addresses (``Cluster(addresses=[...], token=..., tls={"ca": ...})``): the
static runtime, for plain machines and Kubernetes pods without Ray.

Each worker is a ``flightshuffle worker`` process that you (or a supervisor: systemd, a
Kubernetes StatefulSet, a shell loop) run on its host::

    flightshuffle worker --listen 0.0.0.0:7000 --advertise host1:7000 \\
        --token-file /etc/flightshuffle/token --spill-dir /var/tmp/fs \\
        --tls-cert cert.pem --tls-key key.pem --tls-ca ca.pem

``flightshuffle certs DIR --host host1 --host host2`` makes a CA and a certificate naming the
hosts. The driver stays in your process and dials the addresses; data moves between workers.
Nothing here can start a worker, so a lost worker is recovered once its supervisor restarts
it at the same address: the driver waits up to ``restart_wait`` seconds for a new process
there (a process that was only paused is told to exit first), then recomputes what was lost
on it from lineage, as on a local cluster. When nothing answers in time, a surviving worker
starts a *stand-in* beside itself for the lost slot (``take_over=True``, the default): a
second worker process with the same command line, its own port and spill directory, its
token on a pipe the survivor holds (it exits with the survivor). Lineage recomputes the lost
slot's work there, so the job still ends with the exact answer on the hosts left. With
``take_over=False``, or when no survivor can start one, the job fails with an error naming
the worker. The workers' own flags set their memory budget, spill directory and
compression (``auto``: LZ4 when listening on a network address).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from flightshuffle._native import NativeCluster

TOKEN_ENV = "FLIGHTSHUFFLE_TOKEN"


def _tls_files(tls: Any) -> tuple[str, tuple[str, str, str] | None]:
    """``tls=`` of a static cluster as the native mode and files: the CA that signed the
    workers' certificates, and under mutual TLS the driver's own certificate and key."""
    if tls is False:
        return "off", None
    if not isinstance(tls, dict) or "ca" not in tls:
        raise ValueError(
            'a cluster of workers at addresses= needs tls={"ca": path} (the CA that signed the '
            "workers' certificates; `flightshuffle certs` makes them), with cert and key too "
            'for "mutual": True, or tls=False for workers started with --insecure'
        )
    unknown = set(tls) - {"ca", "cert", "key", "mutual"}
    if unknown:
        raise ValueError(f"tls= knows ca, cert, key and mutual, not {sorted(unknown)}")
    mutual = bool(tls.get("mutual"))
    if mutual and not {"cert", "key"} <= set(tls):
        raise ValueError('tls={"mutual": True} needs the driver\'s own cert and key too')
    files = (str(tls["ca"]), str(tls.get("cert", "")), str(tls.get("key", "")))
    return ("mutual" if mutual else "on"), files


def connect(
    addresses: Sequence[str],
    token: str | None,
    tls: Any,
    restart_wait: float,
    take_over: bool,
    options: dict[str, Any],
) -> NativeCluster:
    """The native cluster of the workers at ``addresses`` (``host:port``), checked healthy."""
    addresses = [str(a) for a in addresses]
    if not addresses:
        raise ValueError("addresses= names no worker")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"addresses= names a worker twice: {addresses}")
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a worker address is host:port, not {a!r}")
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"a cluster of workers at addresses= needs token= (or ${TOKEN_ENV})")
    if restart_wait < 0:
        raise ValueError(f"restart_wait must be at least 0 seconds, not {restart_wait!r}")
    mode, files = _tls_files(tls)
    options = {**options, "tls": mode, "tls_files": files}
    return NativeCluster.connect_static(
        addresses, token, float(restart_wait), bool(take_over), options
    )
