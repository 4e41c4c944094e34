"""Hosts on one machine: a network namespace each, joined by a network of their own.

Every host gets a namespace with its loopback, and one end of a veth pair on the pod
network, a bridge in the head's namespace (198.19.0.0/24: the head .1, stage host k .1+k),
as pods on one flat network see each other. The test, which stays in the machine's own
namespace, reaches each host over a control link of its own (198.18.S.4k/30, the host at
.4k+2, S the lab's slot): what it reads never crosses the pod network, so a partition of
the pod network hides nothing from it, and no host has a route to another's control link.
Control links are the only addresses in the machine's own namespace, so each lab claims a
slot of its own for them: two labs at once (two test workers) never share an address.
Both ranges are the ones set aside for testing network equipment (RFC 2544); no traffic
leaves these links.

A partition is made on the pod network, the way real networks fail: the link down (its
bridge port, so the stage host loses carrier), or one direction dropped by the kernel's
packet filter (nft) while the other still flows.

Names the head by the name the shipped manifests give it, through `/etc/netns/<ns>/hosts`
(which `ip netns exec` puts in place of /etc/hosts for what runs in the namespace).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

POD_NETWORK = "198.19.0"
CONTROL_NETWORK = "198.18"
SLOTS = Path(tempfile.gettempdir()) / "omni-watchdog-lab-slots"
SLOT_COUNT = 256
NETNS_ETC = Path("/etc/netns")
# Namespaces of this fixture are named PREFIX<creator pid>-<host>: ones whose creator
# died without cleaning up are removed by the next fixture.
PREFIX = "owd"
BRIDGE = "pods0"
NFT_TABLE = "partition"


class Unavailable(Exception):
    """Namespaces cannot be made here; the message says why, in one line."""


@dataclass(frozen=True)
class Host:
    """One host of the lab: its name, its namespace and its two addresses."""

    name: str
    index: int
    netns: str
    pod_ip: str
    control_ip: str

    @property
    def port_name(self) -> str:
        """Its veth end in the head's namespace, on the bridge (stage hosts only)."""
        return f"{BRIDGE[:3]}p{self.index}"


def _run(*argv: str, netns: str | None = None, check: bool = True) -> str:
    command = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (these tests run as root in CI)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return f"cannot make a network namespace here: {error}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def packet_filter_reason() -> str | None:
    """Why one direction cannot be dropped here, or None when nft can."""
    if shutil.which("nft") is None:
        return "no `nft` (the kernel's packet filter) to drop one direction only"
    return None


def remove_abandoned() -> None:
    """Namespaces a fixture left behind when its process died before cleaning up."""
    for line in _run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        creator = name[len(PREFIX) :].partition("-")[0]
        if name.startswith(PREFIX) and creator.isdigit() and not psutil.pid_exists(int(creator)):
            # What still runs there (the creator was killed before it could end it) first.
            for pid in _run("ip", "netns", "pids", name, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def claim_slot() -> int:
    """A slot no living lab holds: a directory made atomically, naming its holder's pid. A
    slot whose holder died is renamed away first, which only one claimant can do."""
    SLOTS.mkdir(parents=True, exist_ok=True)
    for slot in range(SLOT_COUNT):
        claim = SLOTS / str(slot)
        holder = claim / "pid"
        with contextlib.suppress(OSError, ValueError):
            if not psutil.pid_exists(int(holder.read_text())):
                os.rename(claim, SLOTS / f"abandoned-{slot}-{os.getpid()}")
                shutil.rmtree(SLOTS / f"abandoned-{slot}-{os.getpid()}", ignore_errors=True)
        try:
            claim.mkdir()
        except FileExistsError:
            continue
        holder.write_text(str(os.getpid()))
        return slot
    raise Unavailable(f"every one of {SLOT_COUNT} lab slots is held ({SLOTS})")


def release_slot(slot: int) -> None:
    shutil.rmtree(SLOTS / str(slot), ignore_errors=True)


class Network:
    """The hosts' namespaces and links; `close` removes all of it."""

    def __init__(self, head: str, stage_hosts: Sequence[str], names: dict[str, str]) -> None:
        """`head` and `stage_hosts`: host names; `names`: extra names each host resolves,
        to the head's pod address (the manifests' service names)."""
        remove_abandoned()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.slot = claim_slot()
        self.hosts = [
            Host(
                name,
                index,
                f"{self.tag}-{name}",
                f"{POD_NETWORK}.{index + 1}",
                f"{CONTROL_NETWORK}.{self.slot}.{4 * index + 2}",
            )
            for index, name in enumerate([head, *stage_hosts])
        ]
        self._made: list[str] = []
        try:
            for host in self.hosts:
                self._make_host(host, names)
            self._make_pod_network()
        except BaseException:
            self.close()
            raise

    @property
    def head(self) -> Host:
        return self.hosts[0]

    def host(self, name: str) -> Host:
        return next(host for host in self.hosts if host.name == name)

    def _make_host(self, host: Host, names: dict[str, str]) -> None:
        _run("ip", "netns", "add", host.netns)
        self._made.append(host.netns)
        etc = NETNS_ETC / host.netns
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{host.pod_ip} {host.name}"]
        lines += [f"{self.head.pod_ip} {name}" for name in names.values()]
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        _run("ip", "link", "set", "lo", "up", netns=host.netns)
        # At most 15 characters, unique on this machine while the creator lives.
        outside, inside = f"{PREFIX}{os.getpid() % 100000}c{host.index}", "ctl0"
        _run(
            "ip", "link", "add", outside, "type", "veth",
            "peer", "name", inside, "netns", host.netns,
        )  # fmt: skip
        outer = f"{CONTROL_NETWORK}.{self.slot}.{4 * host.index + 1}"
        _run("ip", "addr", "add", f"{outer}/30", "dev", outside)
        _run("ip", "link", "set", outside, "up")
        _run("ip", "addr", "add", f"{host.control_ip}/30", "dev", inside, netns=host.netns)
        _run("ip", "link", "set", inside, "up", netns=host.netns)

    def _make_pod_network(self) -> None:
        head = self.head.netns
        _run("ip", "link", "add", BRIDGE, "type", "bridge", netns=head)
        _run("ip", "addr", "add", f"{self.head.pod_ip}/24", "dev", BRIDGE, netns=head)
        _run("ip", "link", "set", BRIDGE, "up", netns=head)
        for host in self.hosts[1:]:
            _run(
                "ip", "link", "add", host.port_name, "netns", head, "type", "veth",
                "peer", "name", "eth0", "netns", host.netns,
            )  # fmt: skip
            _run("ip", "link", "set", host.port_name, "master", BRIDGE, "up", netns=head)
            _run("ip", "addr", "add", f"{host.pod_ip}/24", "dev", "eth0", netns=host.netns)
            _run("ip", "link", "set", "eth0", "up", netns=host.netns)

    # --- partitions ------------------------------------------------------------------

    def link_down(self, host: Host) -> None:
        """The stage host's link to the pod network down, both ways (carrier lost)."""
        _run("ip", "link", "set", host.port_name, "down", netns=self.head.netns)

    def link_up(self, host: Host) -> None:
        _run("ip", "link", "set", host.port_name, "up", netns=self.head.netns)

    def drop_from(self, sender: Host, receiver: Host) -> None:
        """Every packet `sender` sends `receiver` on the pod network is dropped as it
        leaves `sender`; the other direction still flows."""
        rules = (
            f"add table inet {NFT_TABLE}\n"
            f"add chain inet {NFT_TABLE} out {{ type filter hook output priority 0 ; }}\n"
            f"add rule inet {NFT_TABLE} out ip daddr {receiver.pod_ip} drop\n"
        )
        done = subprocess.run(
            ["ip", "netns", "exec", sender.netns, "nft", "-f", "-"],
            input=rules, capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"nft in {sender.netns}: {done.stderr.strip()}")

    def stop_dropping(self, sender: Host) -> None:
        _run("nft", "delete", "table", "inet", NFT_TABLE, netns=sender.netns, check=False)

    def heal(self) -> None:
        """Every link up and nothing dropped."""
        for host in self.hosts[1:]:
            self.link_up(host)
        for host in self.hosts:
            self.stop_dropping(host)

    def close(self) -> None:
        for netns in reversed(self._made):
            _run("ip", "netns", "del", netns, check=False)
            shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)
        self._made.clear()
        release_slot(self.slot)


def enter(host: Host) -> list[str]:
    """The argv prefix that runs a command on `host`: its network namespace, and a pid
    namespace of its own with its own /proc, so what runs there sees only its own
    processes, as on a host of its own. The command is the namespace's first process (its
    init); `--kill-child`: when the `unshare` that started it dies, so does everything
    in the namespace."""
    return [
        "ip", "netns", "exec", host.netns,
        "unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
    ]  # fmt: skip
