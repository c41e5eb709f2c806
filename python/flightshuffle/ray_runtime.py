"""Workers hosted on Ray (``Cluster(runtime="ray")``): the multi-machine deployment.

Each worker is a Ray actor that starts the same worker process as the local cluster (Flight
server, block store, Python tasks) on its node and holds it: the process listens on the node's
IP, gets the cluster token on its stdin (never in an environment), and dies with its actor
(``PR_SET_PDEATHSIG``, and its stdin closing), so killing the actor fences the worker, a paused
one too. The actors sit in a placement group of one bundle per worker, spread across nodes. The
driver stays in the user's process and dials the workers over Flight; data moves between workers
over Flight, never through Ray's object store. When the driver finds a worker lost (a failed
call or health check), it asks :meth:`RayWorkers.replace` for a new actor in the same bundle,
and recovery goes on as on the local cluster.

TLS is on by default: the driver makes a CA, whose key never leaves the driver; each actor makes
its own key on its node and sends a certificate request, which the driver signs for that node's
IP (and loopback), so a replacement on a node that joined later is fine. Nothing secret is an
actor's constructor argument (Ray keeps those for the actor's lifetime): the cluster token and the
certificate reach the actor as arguments of one method call (``WorkerHost.start``), which Ray
passes inline and does not keep after the call; the worker process gets the token on its stdin.
With your own certificates (``tls={...}``), their one key goes to every actor the same way. Tables given as Arrow data are written under the driver's scratch directory
(``spill_dir``), which workers on other machines must see at the same path (a shared mount).
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

READY_LINE = "FLIGHTSHUFFLE_WORKER_READY"
#: Resources of each worker's bundle and actor, unless ``ray_resources`` says otherwise.
DEFAULT_RESOURCES: dict[str, float] = {"CPU": 1}


def _die_with_parent() -> None:
    """In the worker process before it runs: SIGKILL it when its actor's process dies."""
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6").prctl(pr_set_pdeathsig, int(signal.SIGKILL))


class WorkerHost:
    """The body of a worker actor: starts one worker process and holds it.

    Made with no secret: Ray keeps an actor's constructor arguments (its creation task) in its
    control store for the actor's lifetime. The actor makes its own TLS key, which never leaves
    its node, and returns a certificate request (:meth:`request`); the driver signs it and
    hands the certificate and the cluster token to :meth:`start`, a method call, whose arguments
    Ray passes inline to the actor and does not keep once the call is done."""

    def __init__(self, slot: int) -> None:
        import ray

        self.slot = slot
        self.dir = tempfile.mkdtemp(prefix="flightshuffle-ray-")
        self.ip = ray.util.get_node_ip_address()
        self.key = os.path.join(self.dir, "key.pem")
        self.proc: subprocess.Popen[str] | None = None
        self.addr = ""

    def request(self) -> tuple[str, str]:
        """Make this worker's TLS key (private, in its directory) and return its node's IP and
        a certificate request for the key."""
        from flightshuffle._native import make_cert_request

        return self.ip, make_cert_request(self.key, [self.ip])

    def start(
        self, argv: list[str], token: str, tls: dict[str, Any] | None, startup_timeout: float
    ) -> str:
        """Start the worker process with these flags; ``tls``: PEM text of the CA and of this
        worker's certificate (signed for the key :meth:`request` made), or also a ``key`` (the
        user's own files), and ``mutual``. Returns the worker's address."""
        slot, ip = self.slot, self.ip
        tls_args: list[str] = []
        if tls:
            if "key" in tls:
                _write_private(self.key, tls["key"])
            for name, flag in (("ca", "--tls-ca"), ("cert", "--tls-cert")):
                path = os.path.join(self.dir, f"{name}.pem")
                _write_private(path, tls[name])
                tls_args += [flag, path]
            tls_args += ["--tls-key", self.key]
            if tls.get("mutual"):
                tls_args.append("--tls-client-auth")
        host = f"[{ip}]" if ":" in ip else ip
        cmd = [
            sys.executable,
            "-m",
            "flightshuffle.worker",
            "--id",
            f"worker-{slot}",
            "--listen",
            f"{host}:0",
            "--spill-dir",
            os.path.join(self.dir, "spill"),
            *argv,
            "--exit-with-stdin",
            "--token-stdin",
            *tls_args,
        ]
        env = {k: v for k, v in os.environ.items() if k != "FLIGHTSHUFFLE_TOKEN"}
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, before exec
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(token + "\n")
        self.proc.stdin.flush()
        ready: queue.Queue[str | None] = queue.Queue()
        threading.Thread(
            target=_drain, args=(self.proc.stdout, ready), name="worker-stdout", daemon=True
        ).start()
        try:
            addr = ready.get(timeout=startup_timeout)
        except queue.Empty:
            self.stop()
            raise TimeoutError(
                f"worker {slot} did not start within {startup_timeout:.0f} s on {ip}"
            ) from None
        if addr is None:
            code = self.proc.wait()
            self.stop()
            raise RuntimeError(
                f"worker {slot} exited with code {code} before it was ready on {ip} "
                "(its stderr is in the Ray worker logs)"
            )
        self.addr = addr
        return addr

    def address(self) -> str:
        return self.addr

    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def node_ip(self) -> str:
        return self.ip

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _drain(out: Any, ready: queue.Queue[str | None]) -> None:
    """Put the worker's address (from its ready line) on ``ready``, or None if it exits
    first; then keep reading so it never blocks on a full stdout."""
    sent = False
    for line in out:
        if not sent and line.startswith(READY_LINE):
            ready.put(line[len(READY_LINE) :].strip())
            sent = True
    if not sent:
        ready.put(None)


def _actor_options(resources: dict[str, float]) -> dict[str, Any]:
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}
    opts: dict[str, Any] = {"num_cpus": resources.get("CPU", 0), "max_restarts": 0}
    if "GPU" in resources:
        opts["num_gpus"] = resources["GPU"]
    if "memory" in resources:
        opts["memory"] = resources["memory"]
    if rest:
        opts["resources"] = rest
    return opts


class RayWorkers:
    """``workers`` worker actors on Ray, one bundle each in a placement group spread across
    nodes. ``address`` is passed to ``ray.init`` when Ray is not initialised yet (None: a
    local Ray instance, or the one ``RAY_ADDRESS`` names; ``"auto"``; ``"ray://..."``)."""

    def __init__(
        self,
        workers: int,
        address: str | None,
        resources: dict[str, float] | None,
        tls: Any,
        startup_timeout: float = 120.0,
    ) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError as e:
            raise ImportError(
                'runtime="ray" needs Ray: pip install "flightshuffle[ray]" (or pip install ray)'
            ) from e
        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, include_dashboard=False, logging_level="warning")
        self.startup_timeout = startup_timeout
        self.resources = dict(resources or DEFAULT_RESOURCES)
        self.token = secrets.token_hex(16)
        self.replaced = 0
        self._lock = threading.Lock()
        self._tls_dir: str | None = None
        self.node_ips = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
        self.tls_mode, self.tls_files, self.pem = self._tls(tls)
        self.worker_args: list[str] = []
        self.actors: list[Any] = []
        self.addresses: list[str] = []
        self.workers = workers
        self.pg = placement_group([dict(self.resources)] * workers, strategy="SPREAD")
        try:
            ray.get(self.pg.ready(), timeout=startup_timeout)
        except Exception as e:
            available = ray.available_resources()
            self.stop()  # the placement group, and Ray itself if we started it
            raise RuntimeError(
                f"Ray could not place {workers} workers with {self.resources} each within "
                f"{startup_timeout:.0f} s (available: {available}); lower "
                f"ray_resources or add nodes: {e}"
            ) from e

    def start(self, worker_args: list[str]) -> list[str]:
        """Start every worker actor with these worker flags; returns their addresses."""
        if self.tls_mode == "off" and any(not _loopback(ip) for ip in self.node_ips):
            worker_args = [*worker_args, "--insecure"]  # asked for explicitly: tls=False
        self.worker_args = worker_args
        started = [self._start(i) for i in range(self.workers)]
        self.actors = [actor for actor, _ in started]
        self.addresses = [
            str(a) for a in self._ray.get([ref for _, ref in started], timeout=self.startup_timeout)
        ]
        return self.addresses

    def _tls(self, tls: Any) -> tuple[str, tuple[str, str, str] | None, dict[str, Any] | None]:
        """The native TLS mode, the files the driver reads, and the PEM text for actors (with
        the key only for the user's own files: a made CA signs each actor's own key)."""
        from flightshuffle._native import make_tls

        if tls is False:
            return "off", None, None
        if isinstance(tls, dict):
            files = (str(tls["ca"]), str(tls["cert"]), str(tls["key"]))
            mutual = bool(tls.get("mutual"))
        else:
            self._tls_dir = tempfile.mkdtemp(prefix="flightshuffle-tls-")
            files = make_tls(self._tls_dir, self.node_ips)
            mutual = tls == "mutual"
        pem: dict[str, Any] = {}
        names = ("ca", "cert", "key") if self._tls_dir is None else ("ca",)
        for name, path in zip(names, files, strict=False):
            with open(path) as f:
                pem[name] = f.read()
        pem["mutual"] = mutual
        return ("mutual" if mutual else "on"), files, pem

    def _start(self, slot: int) -> tuple[Any, Any]:
        """A new actor in slot ``slot``'s bundle, and the reference of its worker's address.
        With a made CA, the actor's certificate request is signed here for the node it landed
        on (so a node that joined since the start is fine)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from flightshuffle._native import sign_cert_request

        actor = (
            self._ray.remote(WorkerHost)
            .options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=slot
                ),
                **_actor_options(self.resources),
            )
            .remote(slot)
        )
        tls = self.pem
        if tls is not None and self._tls_dir is not None:
            ip, request = self._ray.get(actor.request.remote(), timeout=self.startup_timeout)
            tls = {**tls, "cert": sign_cert_request(self._tls_dir, request, [ip])}
        started = actor.start.remote(self.worker_args, self.token, tls, float(self.startup_timeout))
        return actor, started

    def replace(self, slot: int) -> str:
        """Kill slot ``slot``'s actor (which kills its worker, a paused one too) and start a
        new one in the same bundle; returns its address (called by the driver)."""
        with self._lock:
            with contextlib.suppress(Exception):
                self._ray.kill(self.actors[slot], no_restart=True)
            actor, started = self._start(slot)
            addr = self._ray.get(started, timeout=self.startup_timeout)
            self.actors[slot] = actor
            self.replaced += 1
            return str(addr)

    def remove(self, slot: int) -> None:
        """Stop slot ``slot``'s actor for good (the driver retired it): the last slot's actor
        takes its index, as it did in the driver; its bundle stays reserved."""
        with self._lock:
            with contextlib.suppress(Exception):
                self._ray.kill(self.actors[slot], no_restart=True)
            last = self.actors.pop()
            if slot < len(self.actors):
                self.actors[slot] = last

    def kill(self, slot: int) -> None:
        """Kill one worker's actor, as a lost node would (fault injection in tests)."""
        self._ray.kill(self.actors[slot], no_restart=True)

    def pids(self) -> list[int]:
        """The worker processes' ids by slot (0 where an actor does not answer)."""
        out = []
        for a in list(self.actors):
            try:
                out.append(int(self._ray.get(a.pid.remote(), timeout=10)))
            except Exception:  # noqa: BLE001 - a dead or busy actor
                out.append(0)
        return out

    def stop(self) -> None:
        """Stop every worker and actor, free the placement group; shut Ray down if we
        started it. Safe to call more than once."""
        actors, self.actors = list(getattr(self, "actors", [])), []
        for a in actors:
            with contextlib.suppress(Exception):
                self._ray.get(a.stop.remote(), timeout=10)
            with contextlib.suppress(Exception):
                self._ray.kill(a, no_restart=True)
        self._remove_pg()
        if self._tls_dir:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
            self._tls_dir = None
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False

    def _remove_pg(self) -> None:
        from ray.util.placement_group import remove_placement_group

        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"
