"""Hosts with real network limits, simulated on one machine: each "host" is a network
namespace with an address of its own, joined to the others by a bridge, its link capped in
both directions with ``tc ... tbf`` (this kernel has ``tbf``, not ``netem``: links get a rate,
not a latency). The driver stays in the machine's own namespace, on the bridge's address.
Needs root (``CAP_NET_ADMIN``); :func:`unavailable` says why it cannot run where it cannot.
Everything made (namespaces, links, the bridge, the processes started in the hosts) carries a
name of this run and is removed by :meth:`SimHosts.down`, also after a failure.

    with SimHosts(3, rate="1gbit") as hosts:
        proc = hosts.run(0, ["python", "-m", "flightshuffle.worker", ...])

``flightshuffle-bench simhosts`` measures shuffles over such links (see :mod:`.hostsbench`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from typing import Any, Self

#: The /24 the hosts live in (an unusual private range, unlikely to be in use).
SUBNET = "10.213.77"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def _tc(*args: str, ns: str | None = None) -> None:
    cmd = ["tc", *args] if ns is None else ["ip", "netns", "exec", ns, "tc", *args]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30)


def unavailable() -> str | None:
    """Why simulated hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (CAP_NET_ADMIN) for network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the {tool!r} command (iproute2)"
    probe = f"fsprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot make a network namespace here: {getattr(e, 'stderr', e)}".strip()
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> None:
    """Remove the namespaces and links of runs whose process is gone (killed before
    :meth:`SimHosts.down` ran): names ``fs<pid>...`` of a pid that no longer runs this."""
    import re

    names = (
        subprocess.run(
            ["ip", "-o", "link", "show"], capture_output=True, text=True, check=False
        ).stdout
        + subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=False
        ).stdout
    )
    for tag in set(re.findall(r"\bfs(\d+)[bohi]\d*\b", names)):
        if os.path.exists(f"/proc/{tag}") or int(tag) == os.getpid():
            continue
        for ns in re.findall(rf"\b(fs{tag}h\d+)\b", names):
            for pid in subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout.split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)
        for link in set(re.findall(rf"\b(fs{tag}[bo]\d*)\b", names)):
            _ip("link", "del", link, check=False)


def rate_bytes(rate: str) -> float:
    """``"1gbit"``, ``"500mbit"``, ``"10gbit"`` in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"a rate is like 1gbit or 500mbit, not {rate!r}")


class SimHosts:
    """``n`` simulated hosts, each with a link of ``rate`` (``None``: uncapped)."""

    def __init__(self, n: int, rate: str | None = "1gbit") -> None:
        if not 1 <= n <= 200:
            raise ValueError("between 1 and 200 hosts")
        self.n = n
        self.rate = rate
        tag = f"fs{os.getpid()}"  # at most 7 digits: link names stay within 15 characters
        self.bridge = f"{tag}b"
        self.namespaces = [f"{tag}h{i}" for i in range(n)]
        self.outer = [f"{tag}o{i}" for i in range(n)]  # the bridge's end of host i's link
        self.inner = [f"{tag}i{i}" for i in range(n)]  # host i's end
        self.driver_ip = f"{SUBNET}.1"
        self.ips = [f"{SUBNET}.{10 + i}" for i in range(n)]
        self.procs: list[subprocess.Popen[Any]] = []

    def up(self) -> Self:
        """Make the bridge, the namespaces and their capped links (after removing what a run
        killed before it could clean up left: names of a process that is gone)."""
        sweep_stale()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.driver_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for ns, outer, inner, ip in zip(
                self.namespaces, self.outer, self.inner, self.ips, strict=True
            ):
                _ip("netns", "add", ns)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", inner, "netns", ns)
                _ip("link", "set", outer, "master", self.bridge, "up")
                _ip("addr", "add", f"{ip}/24", "dev", inner, ns=ns)
                _ip("link", "set", inner, "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
                if self.rate is not None:
                    self._cap(outer, None)  # what reaches the host
                    self._cap(inner, ns)  # what leaves it
        except BaseException:
            self.down()
            raise
        return self

    def _cap(self, dev: str, ns: str | None) -> None:
        assert self.rate is not None
        # A bucket of at least one timer tick's worth of bytes, or tbf cannot reach its rate.
        burst = max(256 * 1024, int(rate_bytes(self.rate) / 250))
        _tc(
            "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
            "burst", str(burst), "latency", "10ms", ns=ns,
        )  # fmt: skip

    def run(self, host: int, cmd: list[str], **popen: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in host ``host`` (stopped by :meth:`down`)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *cmd], **popen)
        self.procs.append(proc)
        return proc

    def start_worker(
        self,
        host: int,
        files: dict[str, str],
        spill_dir: str,
        args: list[str] | None = None,
        supervise: bool = False,
        port: int = 7000,
        timeout: float = 60.0,
    ) -> str:
        """Start a ``flightshuffle worker`` in host ``host`` with the TLS files and token
        file of ``flightshuffle certs`` (``files``); returns its address. ``supervise``: a
        shell loop starts it again whenever it exits, as systemd or Kubernetes would."""
        import sys

        cmd = [
            sys.executable, "-m", "flightshuffle.worker", "--id", f"host{host}",
            "--listen", f"{self.ips[host]}:{port}", "--spill-dir", spill_dir,
            "--token-file", files["token_file"], "--tls-cert", files["cert"],
            "--tls-key", files["key"], "--tls-ca", files["ca"], *(args or []),
        ]  # fmt: skip
        if supervise:
            cmd = ["bash", "-c", 'while true; do "$@"; sleep 0.2; done', "supervisor", *cmd]
        proc = self.run(host, cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        import select

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                if line.startswith("FLIGHTSHUFFLE_WORKER_READY"):
                    # Drained from here on, so that a chatty worker never blocks on its pipe.
                    threading.Thread(target=proc.stdout.read, daemon=True).start()
                    return line.split()[1]
                if not line and proc.poll() is not None:
                    break
        raise RuntimeError(f"the worker in host {host} did not start (exit {proc.poll()})")

    def worker_pids(self, host: int) -> list[int]:
        """The pids of the worker processes running in host ``host`` (not their supervisor),
        in the order the kernel lists them."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[host]],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        pids = []
        for pid in out:
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                if b"flightshuffle.worker" in argv and b"while true" not in b" ".join(argv):
                    pids.append(int(pid))
        return sorted(pids)

    def worker_pid(self, host: int) -> int:
        """The pid of the (first) worker process running in host ``host``."""
        pids = self.worker_pids(host)
        if not pids:
            raise LookupError(f"no worker runs in host {host}")
        return pids[0]

    def link_bound(self, bytes_per_host: float) -> float:
        """Seconds for every host to send (and receive) ``bytes_per_host`` over its link."""
        if self.rate is None:
            return 0.0
        return bytes_per_host / rate_bytes(self.rate)

    def down(self) -> None:
        """Stop the processes started here and remove everything made. Safe to call twice."""
        procs, self.procs = self.procs, []
        for p in procs:
            with contextlib.suppress(OSError):
                p.kill()
            with contextlib.suppress(Exception):
                p.wait(timeout=10)
        for ns in self.namespaces:
            # Whatever still runs in the namespace (a worker a supervisor restarted).
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)
        for outer in self.outer:
            _ip("link", "del", outer, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Self:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
