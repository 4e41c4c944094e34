"""Which process is at the other end of a connection to the watchdog, read from /proc.

A span names the process it speaks for by pid and start, and both are world-readable in
/proc: a claim proves nothing. The connection it came on does. For a peer in this network
namespace (loopback, or an address of this host), the kernel's socket table
(`/proc/net/tcp`, `tcp6`) gives the inode of the peer's socket, and a process holds that
socket exactly when one of its descriptors links to `socket:[inode]`. No process can put
its socket into another's descriptor table, so a process that is not the one it claims to
be cannot pass (root, or the server's own user through ptrace, can: see the README).

A peer whose socket is not in the table is on another host or in another namespace: this
check says nothing of it, and the token is what speaks for it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from omni_watchdog.process_start import PROC

# Of a socket table's line: the local and remote addresses, and the inode.
_LOCAL, _REMOTE, _INODE = 1, 2, 9
_MAPPED_PREFIX = "::ffff:"


def _kernel_text(packed: bytes, port: int) -> str:
    # Each 32-bit word of the address in host order (little-endian here), as the kernel
    # prints them.
    words = [packed[i : i + 4] for i in range(0, len(packed), 4)]
    text = "".join(int.from_bytes(w, "big").to_bytes(4, "little").hex().upper() for w in words)
    return f"{text}:{port:04X}"


def kernel_forms(host: str, port: int) -> list[tuple[str, str]]:
    """The (table, `HEX:PORT`) forms in which /proc may list a socket at this address: an
    IPv4 address is an IPv4 socket's in `tcp`, or an IPv6 socket's, mapped, in `tcp6`."""
    if host.lower().startswith(_MAPPED_PREFIX) and "." in host:
        host = host[len(_MAPPED_PREFIX) :]
    if ":" in host:
        return [("tcp6", _kernel_text(socket.inet_pton(socket.AF_INET6, host), port))]
    packed = socket.inet_pton(socket.AF_INET, host)
    mapped = bytes(10) + b"\xff\xff" + packed
    return [("tcp", _kernel_text(packed, port)), ("tcp6", _kernel_text(mapped, port))]


def is_loopback(host: str) -> bool:
    """The address is this host's loopback, where every peer is a process of this host."""
    if host.lower().startswith(_MAPPED_PREFIX):
        host = host[len(_MAPPED_PREFIX) :]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SocketOwners:
    """Reads the socket tables and descriptor links of /proc (`proc`, for tests)."""

    def __init__(self, proc: Path = PROC) -> None:
        self._proc = proc

    def peer_inode(self, peer: tuple[str, int], local: tuple[str, int]) -> int | None:
        """The inode of the socket at `peer` connected to `local`, if it is in this
        network namespace; None if it is not. OSError: the tables cannot be read."""
        locals_by_table = dict(kernel_forms(*local))
        for table, peer_text in kernel_forms(*peer):
            local_text = locals_by_table.get(table)
            if local_text is None:
                continue
            path = self._proc / "net" / table
            with open(path, encoding="ascii", errors="replace") as lines:
                next(lines, None)  # the heading
                for line in lines:
                    fields = line.split()
                    if (
                        len(fields) > _INODE
                        and fields[_LOCAL] == peer_text
                        and fields[_REMOTE] == local_text
                    ):
                        return int(fields[_INODE])
        return None

    def holders(self, inode: int, pids: Iterable[int]) -> tuple[set[int], set[int]]:
        """Those of `pids` that hold the socket `inode` in their descriptor table, and
        those whose table this process may not read (another user's, without ptrace
        rights); a process gone holds nothing."""
        wanted = f"socket:[{inode}]"
        found: set[int] = set()
        unreadable: set[int] = set()
        for pid in pids:
            directory = self._proc / str(pid) / "fd"
            try:
                names = os.listdir(directory)
            except PermissionError:
                unreadable.add(pid)
                continue
            except OSError:
                continue
            for name in names:
                try:
                    if os.readlink(directory / name) == wanted:
                        found.add(pid)
                        break
                except PermissionError:
                    unreadable.add(pid)
                    break
                except OSError:
                    continue
        return found, unreadable
