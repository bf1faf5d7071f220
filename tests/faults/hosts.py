"""Test hosts: network namespaces on a bridge of the run's own, built and removed by the run.

    with Hosts(3) as hosts:                        # 3 namespaces on a private 10.200.X.0/24
        hosts.address                              # the bridge's address: where the services listen
        subprocess.Popen([*hosts.exec_prefix(1), "python", ...])   # a process on host 1
        hosts.cut(1); ...; hosts.heal(1)           # host 1 off the network, and back

A host is a network namespace ``kf<tag>h<i>`` with loopback up and one interface, ``eth0``
(``10.200.X.<10 + i>/24``), the peer of a veth ``kf<tag>v<i>`` plugged into the bridge ``kf<tag>br``
(``10.200.X.1/24``, in the root namespace). Processes of a host reach the services on the bridge's
address and nothing else: not the root namespace's loopback, not the other hosts' loopbacks.

**Cut** sets the root end of the host's veth down: the host's interface loses its carrier, every
packet either way is dropped (TCP connections stall and retransmit, new connections fail), for all
of the host's processes at once. **Heal** sets it up again: the same connections resume (nothing was
reset). Needs root (``CAP_NET_ADMIN``) and ``ip`` (iproute2).

Cleanup: every name carries the run's tag, and the tag's registry file
(``/tmp/kc-hosts/<tag>.json``: owner pid and its start time, the subnet) is written before anything
is built. :meth:`Hosts.close` (also on leaving the ``with``) removes the namespaces, veths and bridge;
:func:`destroy` does the same for a tag (the harness's watchdog calls it when the orchestrator died);
each new :class:`Hosts` first removes what runs of dead owners left (:func:`clean_stale`), and
namespaces or links named like ours that no registry claims.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import subprocess
import uuid
from pathlib import Path

REGISTRY = Path("/tmp/kc-hosts")
#: Names built by this module: ``kf`` + a 5-hex-digit tag + ``br`` / ``v<i>`` / ``h<i>``.
NAME_RE = re.compile(r"^kf([0-9a-f]{5})(?:br|v\d+|h\d+)$")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> str | None:
    """``None`` when hosts can be built here, else why not."""
    if os.geteuid() != 0:
        return "test hosts are network namespaces: they need root (CAP_NET_ADMIN)"
    try:
        ip("netns", "list")
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(entry: dict[str, object]) -> bool:
    pid = entry.get("pid")
    return isinstance(pid, int) and _start_time(pid) == entry.get("start")


def _netns_names() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = ip("-o", "link", "show", check=False).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def destroy(tag: str) -> None:
    """Remove every namespace and link of ``tag``, and its registry file (idempotent)."""
    for name in _netns_names():
        m = NAME_RE.match(name)
        if m and m.group(1) == tag:
            ip("netns", "delete", name, check=False)  # its eth0 goes with it, and so does the veth
    for name in _link_names():
        m = NAME_RE.match(name)
        if m and m.group(1) == tag:
            ip("link", "delete", name, check=False)
    (REGISTRY / f"{tag}.json").unlink(missing_ok=True)


def _registered() -> dict[str, dict[str, object]]:
    out = {}
    for f in REGISTRY.glob("*.json"):
        try:
            out[f.stem] = json.loads(f.read_text())
        except (OSError, ValueError):
            out[f.stem] = {}
    return out


def clean_stale() -> list[str]:
    """Remove what runs whose owner is gone left behind (their tags' namespaces, links, registry
    files), and names of ours no registry claims. Returns the tags removed."""
    reg = _registered()
    dead = {tag for tag, entry in reg.items() if not _owner_alive(entry)}
    for name in _netns_names() + _link_names():
        m = NAME_RE.match(name)
        if m and m.group(1) not in reg:
            dead.add(m.group(1))
    for tag in sorted(dead):
        destroy(tag)
    return sorted(dead)


def _subnets_in_use() -> set[int]:
    """The X of every 10.200.X.0/24 an address or route of the root namespace, or a live run, uses."""
    text = (
        ip("-o", "-4", "addr", "show", check=False).stdout
        + ip("-4", "route", "show", "table", "all", check=False).stdout
    )
    used = {int(x) for x in re.findall(r"\b10\.200\.(\d+)\.", text)}
    used |= {int(str(e["subnet"])) for e in _registered().values() if "subnet" in e}
    return used


class Hosts:
    """``n`` hosts (1..n) on a bridge of their own; see the module's docstring.

    Parameters
    ----------
    n:
        How many hosts.
    owner_pid:
        The process whose death makes these hosts stale (default: this one).
    """

    def __init__(self, n: int, owner_pid: int | None = None) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(why)
        self.n = n
        self.tag = ""
        REGISTRY.mkdir(parents=True, exist_ok=True)
        with open(REGISTRY / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            clean_stale()
            used = _subnets_in_use()
            free = [x for x in range(0, 256) if x not in used]
            if not free:
                raise RuntimeError("no free 10.200.X.0/24 for the test hosts")
            self.subnet = random.choice(free)
            taken = set(_registered())
            while not self.tag or self.tag in taken:
                self.tag = uuid.uuid4().hex[:5]
            pid = owner_pid or os.getpid()
            (REGISTRY / f"{self.tag}.json").write_text(
                json.dumps({"pid": pid, "start": _start_time(pid), "subnet": self.subnet, "n": n})
            )
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- names ----------------------------------------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"kf{self.tag}br"

    @property
    def address(self) -> str:
        """The bridge's address in the root namespace: the services listen here."""
        return f"10.200.{self.subnet}.1"

    def netns(self, i: int) -> str:
        return f"kf{self.tag}h{i}"

    def veth(self, i: int) -> str:
        """The root end of host ``i``'s veth (on the bridge)."""
        return f"kf{self.tag}v{i}"

    def host_address(self, i: int) -> str:
        return f"10.200.{self.subnet}.{10 + i}"

    def exec_prefix(self, i: int) -> list[str]:
        """Prepend to a command line to run it on host ``i`` (the command keeps its pid: ``ip``
        enters the namespace and execs it)."""
        return ["ip", "netns", "exec", self.netns(i)]

    # -- build, cut, heal, remove ---------------------------------------------------------------
    def _build(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(1, self.n + 1):
            ns, veth = self.netns(i), self.veth(i)
            ip("netns", "add", ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge)
            ip("link", "set", veth, "up")
            ip("-n", ns, "addr", "add", f"{self.host_address(i)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", "eth0", "up")

    def cut(self, i: int) -> None:
        """Host ``i`` off the network: no packet in or out until :meth:`heal`."""
        ip("link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        ip("link", "set", self.veth(i), "up")

    def close(self) -> None:
        if self.tag:
            destroy(self.tag)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
