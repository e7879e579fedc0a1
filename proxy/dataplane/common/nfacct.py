"""nfacct objects: the kernel's named packet and byte counters (nfnetlink_acct), which
an xtables rule matches with `-m nfacct --nfacct-name NAME` (xt_nfacct) and counts into.
They live beside the rules, not in them: rewriting a chain, a whole table (legacy
iptables-restore) or restarting the agent leaves them as they are, which rule counters
would not survive. The iptables mode counts its traffic with them (common/traffic.py).

The kernel's side (net/netfilter/nfnetlink_acct.c), which decides how this is written:
- NEW of a name that exists answers EEXIST (with NLM_F_EXCL) or EBUSY (without), and
  with NLM_F_REPLACE resets it to zero: never sent. Either answer means "there already".
- A rule takes a reference (xt_nfacct's checkentry finds the name, or refuses the rule
  with ENOENT: so an object is created before the restore that first names it). DEL of
  an object a rule still holds answers EBUSY; DEL with no name deletes EVERY unused
  object of the namespace, anyone's: never sent.
- Objects are per network namespace, not per family; the list is searched linearly by
  name (NEW, DEL and each rule's checkentry), so their number is the cost of each.
- A dump gives each object's name, packets, bytes (big-endian 64 bits) and its use
  count (1: no rule holds it).

Only names with our PREFIX are ever created, read or deleted here.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import struct
from collections.abc import Iterable
from contextlib import closing
from typing import NamedTuple, Protocol

from proxy.dataplane.common.netlink import (
    ATTR,
    NetlinkError,
    NetlinkSocket,
    nfgen,
    nla_string,
)
from proxy.dataplane.common.netlink_constants import (
    NETLINK_NETFILTER,
    NFACCT_BYTES,
    NFACCT_NAME,
    NFACCT_PAD,
    NFACCT_PKTS,
    NFACCT_USE,
    NFNL_MSG_ACCT_DEL,
    NFNL_MSG_ACCT_GET,
    NFNL_MSG_ACCT_NEW,
    NFNL_SUBSYS_ACCT,
    NLM_F_CREATE,
    NLM_F_EXCL,
)

log = logging.getLogger(__name__)

# Ours: `spx-` and a kind, a family digit, a dash and a 16-digit hash (common/naming's
# name_hash): "spx-p4-0123456789ABCDEF", 23 bytes.
PREFIX = "spx-"
_NAME = r"spx-[a-z][46]-[0-9A-F]{16}"
_OURS = re.compile(_NAME)
_VALUES = struct.Struct("!QQI")  # packets, bytes, use


class Reading(NamedTuple):
    """One object as the kernel counts it; `use` is 1 when no rule holds it."""

    packets: int
    bytes: int
    use: int = 1


def ours(name: str) -> bool:
    return _OURS.fullmatch(name) is not None


def object_name(kind: str, family_digit: str, digest: str) -> str:
    """`spx-{kind}{4|6}-{digest}`: never user text, always within NFACCT_NAME_MAX
    (netlink_constants)."""
    name = f"{PREFIX}{kind}{family_digit}-{digest}"
    if not ours(name):
        raise ValueError(f"not an nfacct name of ours: {name!r}")
    return name


def of_family(name: str, family_digit: str) -> bool:
    """Whether `name` (ours) belongs to the family `family_digit` ("4" or "6")."""
    return name[len(PREFIX) + 1] == family_digit


class Accounting(Protocol):
    """The kernel's nfacct objects, as the data planes use them (`Nfacct`), or a model
    of them (`MemoryNfacct`)."""

    def dump(self) -> dict[str, Reading]: ...

    def create(self, names: Iterable[str]) -> int: ...

    def delete(self, names: Iterable[str]) -> list[str]: ...


# --- the wire (pure) -----------------------------------------------------------------------


def request(msg: int, name: str | None = None) -> tuple[int, bytes]:
    """(netlink message type, body) of an nfacct request about `name`."""
    body = nfgen(socket.AF_UNSPEC)
    if name is not None:
        body += nla_string(NFACCT_NAME, name)
    return NFNL_SUBSYS_ACCT << 8 | msg, body


# Our objects as the kernel writes them (nfnl_acct_fill_info), attribute headers in host
# order: the name (23 bytes, its NUL: an attribute of 28 bytes), packets, bytes (each
# after a padding attribute where 64-bit values must be aligned), the use count. A name
# cannot hold a NUL, so these bytes are only ever found as attributes of one of ours.
_PAD = re.escape(ATTR.pack(4, NFACCT_PAD))  # empty


def _attr(kind: int, size: int) -> bytes:
    return re.escape(ATTR.pack(4 + size, kind))


_OUR_MESSAGE = re.compile(
    _attr(NFACCT_NAME, 24) + rb"(" + _NAME.encode() + rb")\0"
    + rb"(?:" + _PAD + rb")?" + _attr(NFACCT_PKTS, 8) + rb"(.{8})"
    + rb"(?:" + _PAD + rb")?" + _attr(NFACCT_BYTES, 8) + rb"(.{8})"
    + _attr(NFACCT_USE, 4) + rb"(.{4})", re.DOTALL)


def parse_datagrams(datagrams: Iterable[bytes]) -> dict[str, Reading]:
    """Our objects in a dump's datagrams (other names skipped), found in bulk by one
    regular expression: 10,000 in 8 ms, where walking each message's attributes in
    Python took 25-45 (most of one traffic() at 10,000 ports)."""
    out: dict[str, Reading] = {}
    values, make = _VALUES.unpack, Reading._make
    for data in datagrams:
        for name, packets, count, use in _OUR_MESSAGE.findall(data):
            out[name.decode()] = make(values(packets + count + use))
    return out


# --- the kernel ----------------------------------------------------------------------------


class Nfacct:
    """nfacct over nfnetlink, in the network namespace of the calling thread (a socket
    per call: the data plane's thread may change namespace between them in tests)."""

    def dump(self) -> dict[str, Reading]:
        kind, body = request(NFNL_MSG_ACCT_GET)
        with closing(NetlinkSocket(NETLINK_NETFILTER)) as sock:
            return parse_datagrams(sock.dump_datagrams(kind, body))

    def create(self, names: Iterable[str]) -> int:
        """Create each of `names` that does not exist, at zero; an existing one is left
        as it is (never replaced: that would reset it). How many were created."""
        wanted = _checked(names)
        if not wanted:
            return 0
        requests = [(k, NLM_F_CREATE | NLM_F_EXCL, b)
                    for k, b in (request(NFNL_MSG_ACCT_NEW, n) for n in wanted)]
        with closing(NetlinkSocket(NETLINK_NETFILTER)) as sock:
            codes = sock.execute_raw(requests)
        created = 0
        for name, code in zip(wanted, codes, strict=True):
            if code == 0:
                created += 1
            elif code not in (errno.EEXIST, errno.EBUSY):
                raise NetlinkError(code, f"creating nfacct object {name}")
        return created

    def delete(self, names: Iterable[str]) -> list[str]:
        """Delete each of `names` (gone already: fine); those a rule still holds stay,
        and are returned."""
        doomed = _checked(names)
        if not doomed:
            return []
        requests = [(k, 0, b) for k, b in (request(NFNL_MSG_ACCT_DEL, n) for n in doomed)]
        with closing(NetlinkSocket(NETLINK_NETFILTER)) as sock:
            codes = sock.execute_raw(requests)
        busy = []
        for name, code in zip(doomed, codes, strict=True):
            if code == errno.EBUSY:
                busy.append(name)
            elif code not in (0, errno.ENOENT):
                raise NetlinkError(code, f"deleting nfacct object {name}")
        return busy


def _checked(names: Iterable[str]) -> list[str]:
    out = sorted(set(names))
    for name in out:
        if not ours(name):  # never anyone else's, never the empty name (= all of them)
            raise ValueError(f"not an nfacct name of ours: {name!r}")
    return out


class MemoryNfacct:
    """The kernel's nfacct as a model (for simulated runners: no kernel). Rules do not
    count here; `add` plays traffic."""

    def __init__(self) -> None:
        self.objects: dict[str, Reading] = {}
        self.held: set[str] = set()  # names a rule holds (set by tests)

    def dump(self) -> dict[str, Reading]:
        return {n: r._replace(use=2 if n in self.held else 1)
                for n, r in self.objects.items()}

    def create(self, names: Iterable[str]) -> int:
        fresh = [n for n in _checked(names) if n not in self.objects]
        self.objects.update((n, Reading(0, 0)) for n in fresh)
        return len(fresh)

    def delete(self, names: Iterable[str]) -> list[str]:
        busy = [n for n in _checked(names) if n in self.held]
        for name in _checked(names):
            if name not in self.held:
                self.objects.pop(name, None)
        return busy

    def add(self, name: str, packets: int, count: int = 0) -> None:
        old = self.objects[name]
        self.objects[name] = Reading(old.packets + packets, old.bytes + count)


def remove_ours(accounting: Accounting | None = None) -> tuple[int, list[str]]:
    """Delete every object of ours no rule holds (after our rules are gone: --cleanup, a
    mode switch): (how many were deleted, the names still held)."""
    acct = accounting or Nfacct()
    try:
        present = acct.dump()
    except OSError as exc:  # no nfacct in this kernel: nothing of ours either
        log.debug("nfacct objects not readable", extra={"error": str(exc)})
        return 0, []
    busy = acct.delete(present)
    return len(present) - len(busy), busy
