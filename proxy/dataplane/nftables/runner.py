"""Running nftables scripts: one script, one atomic nf_tables transaction (or, for a
first start's script in parts, one per part: transaction.first_lines).

The only place the nftables mode programs the kernel. A script is the text `nft -f`
reads (`add table ...`, `flush chain ...`, `add rule ...`, `add element ...`); nft sends
all of it as one netlink batch, which the kernel commits whole or not at all.

Three appliers for the same text. The first is ours and takes every script it can:
`send` encodes the script into one netlink batch itself (wire.py) and sends it on a
socket of its own: no read-back of our tables, no parse in C, no child; 10,000
services x 10 endpoints take 3.1 s to render, encode and commit whole, where `nft -f -`
took 4.5 s. The other two are nft's, for what the encoder does not speak and as the
second try when the kernel refuses a full script from the encoder; they cost
differently (measured, nft 1.0.6, a service = a chain and 10 dnat rules):
- in-process, libnftables (Debian's libnftables1) through ctypes: no fork and exec, so
  a one-service change into a table of 10,000 chains takes 7 ms instead of 30 ms (the
  child rereads the table each time). But nft's parse memory lands in the agent's heap,
  and glibc keeps it: a 10,000-service script (8.8 MB) grew the caller's RSS by 392 MiB
  at peak, 366 MiB still held afterwards;
- `nft -f -` as a child for scripts over `subprocess_above` bytes: that memory goes
  with the child (394 MiB there; the caller grew 8 MiB, the script's own text), and
  the full load is no slower (2.5 s against 2.8 s in-process). The child's pid is
  recorded (proxy/dataplane/common/processes.py) so the drift listener knows the commit is
  ours.

Both run in the network namespace of the calling thread: a child is forked into it,
and libnftables opens its netlink socket when its context is made, in the namespace of
that moment. So the context is made lazily, on first use, and a runner refuses any
other thread (or the same thread in another namespace) afterwards.

Errors. nft names the failing line as `<file>:<line>:<first>-<last>: Error: <what>`,
then echoes that line and marks the columns, for syntax errors and kernel refusals
alike (the kernel's refusals read "Could not process rule: <errno text>", whatever the
object; one transaction can report several). libnftables gives no file name and no
line for a script passed as a buffer, and echoes the script's *first* line whatever
line failed; so the in-process path writes the script to a memfd and has libnftables
read it as a file, which reports exactly what `nft -f -` does.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import queue
import re
import shutil
import subprocess
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from proxy.dataplane.common import processes
from proxy.dataplane.common.netlink import NetlinkError, NetlinkSocket
from proxy.dataplane.common.netlink_constants import (
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFT_MSG_GETCHAIN,
    NFT_MSG_GETRULE,
    NFT_MSG_GETSET,
    NFT_MSG_GETSETELEM,
    NFT_MSG_GETTABLE,
)
from proxy.dataplane.nftables import readback, wire
from proxy.dataplane.nftables.counters import Counts, SocketReader, read_counters
from proxy.dataplane.nftables.objects import Key
from proxy.dataplane.nftables.rule_refs import RuleRefs
from proxy.dataplane.nftables.transaction import Script
from proxy.model.types import Family

LIBRARY = "libnftables.so.1"
NFT = "nft"
# Bytes above which a script goes to `nft -f -` (module docstring). Parsing in-process
# costs about 45 bytes of RSS, kept, per script byte: 64 KiB (75 services) grew the
# caller by 4 MiB, 1,000 services (850 KiB) by 41 MiB; a sync's few changed services
# stay far below it.
SUBPROCESS_ABOVE = 64 * 1024
_OUTPUT_JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON
_MAX_ERRORS = 5  # in an NftError's message; one bad reference can fail every rule
_ERROR = re.compile(r"^(?:.*?:(?P<line>\d+):\d+-\d+: )?Error: (?P<what>.*)$")
_CARETS = re.compile(r"^\s*[\^~]+\s*$")


class NftError(Exception):
    """nft refused a transaction; the kernel's ruleset is unchanged.

    `line` is the 1-based line of the script nft named and `offending` that line's text.
    Also raised when nft cannot run at all, and when `nft -f -` was killed for taking
    longer than processes.RUN_TIMEOUT (then the message says the outcome is unknown).
    """

    def __init__(self, message: str, line: int | None = None,
                 offending: str | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.offending = offending


def parse_error(output: str, text: str) -> NftError:
    """The NftError for nft's error output `output` about script `text`."""
    lines = text.splitlines()
    found: list[tuple[int | None, str]] = []
    for raw in output.splitlines():
        match = _ERROR.match(raw)
        if match is not None:
            number = int(match["line"]) if match["line"] else None
            found.append((number or None, match["what"].strip()))
    if not found:
        return NftError(output.strip()[:500] or "nft failed and said nothing")
    said = [f"line {n}: {what}" if n else what for n, what in found[:_MAX_ERRORS]]
    if len(found) > _MAX_ERRORS:
        said.append(f"and {len(found) - _MAX_ERRORS} more errors")
    number = next((n for n, _ in found if n is not None), None)
    offending = lines[number - 1] if number is not None and number <= len(lines) else None
    return NftError("; ".join(said), number, offending)


@functools.cache
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(LIBRARY)
    ctx, text = ctypes.c_void_p, ctypes.c_char_p
    lib.nft_ctx_new.argtypes, lib.nft_ctx_new.restype = [ctypes.c_uint32], ctx
    lib.nft_ctx_free.argtypes, lib.nft_ctx_free.restype = [ctx], None
    for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
        getattr(lib, name).argtypes = [ctx]
        getattr(lib, name).restype = ctypes.c_int
    for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
        getattr(lib, name).argtypes = [ctx]
        getattr(lib, name).restype = text
    lib.nft_ctx_output_get_flags.argtypes = [ctx]
    lib.nft_ctx_output_get_flags.restype = ctypes.c_uint
    lib.nft_ctx_output_set_flags.argtypes = [ctx, ctypes.c_uint]
    lib.nft_ctx_output_set_flags.restype = None
    for name in ("nft_run_cmd_from_buffer", "nft_run_cmd_from_filename"):
        getattr(lib, name).argtypes = [ctx, text]
        getattr(lib, name).restype = ctypes.c_int
    return lib


def unavailable() -> str | None:
    """Why this host cannot run the nftables mode's tools, or None. Loads the library
    and looks the binary up; no kernel access."""
    try:
        _library()
    except OSError as exc:
        return f"{LIBRARY} cannot be loaded (Debian's libnftables1): {exc}"
    except AttributeError as exc:  # an older library without a function we call
        return f"{LIBRARY} lacks a function: {exc}"
    if shutil.which(NFT) is None:
        return f"no {NFT} binary on PATH (Debian's nftables)"
    return None


def _here() -> tuple[int, int, int]:
    """This thread and the network namespace it is in."""
    ns = os.stat("/proc/thread-self/ns/net")
    return threading.get_ident(), ns.st_dev, ns.st_ino


def _buffer(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", "replace")


def _encoded(sock: NetlinkSocket, statements: Callable[[], str | Iterable[wire.Statement]],
             family: Family, tables: Collection[str], first_line: int = 1) -> wire.Batch:
    """One message per line, framed by the batch's begin and end. The lines are counted
    as they are encoded: numbered from the socket's next sequence number, which is then
    taken (nothing else numbers messages on the socket meanwhile: the caller holds its
    lock); encoded again, from `statements()` made again, if it wrapped around."""
    while True:
        first = sock.next_seq()
        batch = wire.encode(statements(), family, tables, first, first_line)
        if sock.reserve(batch.count + 2) == first:
            return batch


class _Committer:
    """A thread sending batches in order on one socket: the first refusal or error
    stops it (later batches are dropped, never left waiting: the caller may be blocked
    handing one over). The kernel reports the committer by thread id, so the thread is
    noted as ours (processes.py) while it lives."""

    def __init__(self, sock: NetlinkSocket) -> None:
        self._sock = sock
        self._queue: queue.Queue[wire.Batch | None] = queue.Queue(maxsize=2)
        self._refused: tuple[wire.Batch, tuple[int, int]] | None = None
        self._error: BaseException | None = None
        self._noted = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nft-commit", daemon=True)
        self._thread.start()
        self._noted.wait()

    def _run(self) -> None:
        tid = threading.get_native_id()
        processes.note_thread(tid)
        self._noted.set()
        try:
            while (batch := self._queue.get()) is not None:
                if self.stopped() or not batch.count:
                    continue
                try:
                    refused = self._sock.first_refusal(
                        batch.pages, acked=(batch.last_seq,),
                        watched=range(batch.begin_seq, batch.last_seq + 1))
                except BaseException as exc:  # raised in the caller's thread (outcome)
                    self._error = exc
                    continue
                if refused is not None:
                    self._refused = batch, refused
        finally:
            processes.forget_thread(tid)

    def stopped(self) -> bool:
        return self._refused is not None or self._error is not None

    def put(self, batch: wire.Batch) -> None:
        self._queue.put(batch)

    def finish(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def outcome(self) -> tuple[wire.Batch, tuple[int, int]] | None:
        if self._error is not None:
            raise self._error
        return self._refused


class NftRunner:
    """Applies nftables scripts and lists the ruleset, in one thread's namespace."""

    def __init__(self, subprocess_above: int = SUBPROCESS_ABOVE) -> None:
        self.subprocess_above = subprocess_above
        self._home: tuple[int, int, int] | None = None  # bound on first use
        self._ctx: int | None = None
        self._tid = 0  # the native id noted with processes while a context lives
        self._socket: NetlinkSocket | None = None  # for encoded batches (wire.py)
        self._socket_tid = 0
        self._lock = threading.Lock()  # close() may come from another thread

    def __enter__(self) -> NftRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_home(self) -> None:
        here = _here()
        if self._home is None:
            self._home = here
        elif here[0] != self._home[0]:
            raise RuntimeError("NftRunner used from a thread other than its first user's: "
                               "its netlink socket is in that thread's network namespace")
        elif here != self._home:
            raise RuntimeError("NftRunner's thread is now in another network namespace "
                               "than at its first use")

    def _context(self) -> int:
        """The libnftables context, made now if need be (caller holds the lock)."""
        if self._ctx is None:
            try:
                lib = _library()
            except (OSError, AttributeError) as exc:
                raise NftError(f"{LIBRARY}: {exc}") from exc
            # Noted before the first commit: the kernel names this thread as committer.
            self._tid = threading.get_native_id()
            processes.note_thread(self._tid)
            ctx = lib.nft_ctx_new(0)  # opens the netlink socket, in this namespace
            if not ctx:
                processes.forget_thread(self._tid)
                raise NftError("nft_ctx_new failed")
            # Output and errors to buffers, never the agent's stdout/stderr.
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            self._ctx = ctx
        return self._ctx

    def run(self, text: str) -> None:
        """Apply `text` as one transaction; raises NftError when nft refuses it."""
        self._check_home()
        if len(text) > self.subprocess_above:
            self._run_child(text)
        else:
            self._run_here(text)

    def _run_here(self, text: str) -> None:
        # Read as a file so errors name their line (module docstring); a memfd never
        # touches a disk and goes with its descriptor.
        fd = os.memfd_create("nft-script", os.MFD_CLOEXEC)
        try:
            data = memoryview(text.encode())
            while data:
                data = data[os.write(fd, data):]
            with self._lock:
                ctx = self._context()
                lib = _library()
                rc = lib.nft_run_cmd_from_filename(ctx, f"/proc/self/fd/{fd}".encode())
                # Reading a buffer also rewinds it: done after every command, or they grow.
                lib.nft_ctx_get_output_buffer(ctx)
                errors = _buffer(lib.nft_ctx_get_error_buffer(ctx))
        finally:
            os.close(fd)
        if rc != 0:
            raise parse_error(errors, text)

    def _netlink(self) -> NetlinkSocket:
        """Our own nf_tables netlink socket, made now if need be (caller holds the lock)."""
        if self._socket is None:
            self._socket_tid = threading.get_native_id()
            processes.note_thread(self._socket_tid)  # it commits as this thread
            try:
                self._socket = NetlinkSocket(NETLINK_NETFILTER)
            except BaseException:
                processes.forget_thread(self._socket_tid)
                raise
        return self._socket

    def send(self, script: str | Script, family: Family, tables: Collection[str]) -> None:
        """Apply `script` (text, or a full script made as it is read) as one transaction
        encoded here (wire.py), without nft and its read-back cache; a script in parts
        (`Script.parts`) as one transaction per part, in order, each sent by a thread
        of its own while the next is made. Raises wire.Unencodable, before touching the
        kernel, for a script outside that dialect (then `run` it: what parts were taken
        meanwhile are inert, and the script's text rewrites them); NftError naming the
        first refused line when the kernel refuses it."""
        self._check_home()
        with self._lock:
            try:
                sock = self._netlink()
                if isinstance(script, Script) and script.parts:
                    found = self._send_parts(sock, script, family, tables)
                else:
                    batch = _encoded(sock, lambda: script if isinstance(script, str)
                                     else script.statements(), family, tables)
                    refused = sock.first_refusal(
                        batch.pages, acked=(batch.last_seq,),
                        watched=range(batch.begin_seq, batch.last_seq + 1)) \
                        if batch.count else None
                    found = None if refused is None else (batch, refused)
            except OSError as exc:
                raise NftError(f"nf_tables netlink: {exc}") from exc
        if found is None:
            return
        batch, (seq, code) = found
        number = batch.line_of(seq)
        if number is None:
            raise NftError(f"the kernel refused the batch: {os.strerror(code)}")
        raise NftError(f"line {number}: Could not process rule: {os.strerror(code)}",
                       number, script.splitlines()[number - 1] if isinstance(script, str)
                       else script.line(number))

    def _send_parts(self, sock: NetlinkSocket, script: Script, family: Family,
                    tables: Collection[str]) -> tuple[wire.Batch, tuple[int, int]] | None:
        """Each part of `script` encoded here while a committer thread sends the one
        before (the kernel's work on a batch is done in the sending thread, outside the
        GIL: at 10,000 services x 10 endpoints ~1 s, beside ~1 s of rendering and
        encoding). The first refusal stops it: (its batch, (sequence number, errno))."""
        committer = _Committer(sock)
        line = 1
        try:
            for part in wire.stages(script.statements()):
                if committer.stopped():
                    break
                committer.put(_encoded(sock, functools.partial(iter, part), family, tables, line))
                line += sum(map(wire.statement_size, part))
        finally:
            committer.finish()
        return committer.outcome()

    def names(self, family: Family, tables: Collection[str]
              ) -> tuple[set[str], list[tuple[str, str]], dict[tuple[str, str], str]]:
        """Which of `tables` exist in `family`, the (table, name) of their chains, and
        of their sets and maps (-> "set" or "map"): read with netlink dumps of names
        only. (`nft list tables` reads every rule of every table first: 25 s at 10,000
        services.)"""
        self._check_home()
        with self._lock:
            try:
                sock = self._netlink()
                found = {kind: [wire.decode_names(kind, r.payload)
                                for r in sock.dump_raw(NFNL_SUBSYS_NFTABLES << 8 | kind,
                                                       wire.dump_request(family))]
                         for kind in (NFT_MSG_GETTABLE, NFT_MSG_GETCHAIN, NFT_MSG_GETSET)}
            except OSError as exc:
                raise NftError(f"nf_tables netlink dump: {exc}") from exc
        present = {t for t, _n, _k in found[NFT_MSG_GETTABLE] if t in tables}
        chains = [(t, n) for t, n, _k in found[NFT_MSG_GETCHAIN] if t in present]
        sets = {(t, n): k for t, n, k in found[NFT_MSG_GETSET] if t in present and k}
        return present, chains, sets

    def elements(self, family: Family, table: str, set_name: str, types: Sequence[str],
                 is_map: bool, keep: readback.Keep | None = None) -> readback.Held:
        """The elements of set or map `set_name` of `table`, keys read as `types`
        (readback.py): one netlink dump; of a map, only those `keep` says, if given.
        Unreadable if a key does not fit them; NftError if the dump fails (or the set is
        missing)."""
        self._check_home()
        with self._lock:
            try:
                return readback.read_held(self._netlink().dump_messages(
                    NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETSETELEM,
                    readback.element_dump_request(family, table, set_name)),
                    family, types, is_map, keep)
            except OSError as exc:
                raise NftError(f"nf_tables netlink dump of {table} {set_name}: {exc}") from exc

    def probe(self, family: Family, table: str, set_name: str, keys: Sequence[Key],
              types: Sequence[str] = (), is_map: bool = False) -> readback.Held:
        """Which of `keys` set `set_name` of `table` holds, asked one by one (a request
        per key, many to a datagram) rather than dumped: a `partial` Held, of their bytes
        for a set, decoded as `elements` does for a map (`types`, `is_map`). The kernel
        answers ENOENT for a key the set lacks and for a set that is not there alike (it
        holds none); NftError if it refuses otherwise."""
        self._check_home()
        raws = wire.element_keys(family, keys)
        kind = NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETSETELEM
        with self._lock:
            try:
                answers = self._netlink().exchange_raw(
                    [(kind, 0, readback.element_get_request(family, table, set_name, raw))
                     for raw in raws])
            except OSError as exc:
                raise NftError(f"nf_tables netlink get of {table} {set_name}: {exc}") from exc
        refused = [c for c, _a in answers if c not in (0, errno.ENOENT)]  # errnos, positive
        if refused:
            raise NftError(f"nf_tables netlink get of {table} {set_name}: "
                           f"{os.strerror(refused[0])}")
        if is_map:
            held = readback.read_held(((a, 0, len(a)) for c, a in answers if c == 0),
                                      family, types, True)
            held.partial = True
            return held
        return readback.Held(raw={r for r, (c, _a) in zip(raws, answers, strict=True)
                                  if c == 0}, partial=True)

    def counters(self, family: Family, tables: Collection[str]) -> Counts:
        """The named counters of `tables` in `family` (counters.py): (table, name) ->
        packets counted (render.py counts a connection's first packet: new
        connections). One netlink dump of every named object of the family."""
        self._check_home()
        with self._lock:
            try:
                return read_counters(self._netlink(), family, tables)
            except OSError as exc:
                raise NftError(f"nf_tables netlink dump of counters: {exc}") from exc

    def counter_reader(self) -> SocketReader:
        """A reader of counters on a socket of its own in this runner's network
        namespace: for a reading on another thread beside this runner's commits
        (apply.py's `traffic_reader`); the caller closes it."""
        self._check_home()
        return SocketReader(NetlinkSocket(NETLINK_NETFILTER))

    def rule_refs(self, family: Family, chains: Iterable[tuple[str, str]]) -> RuleRefs:
        """What the rules of `chains` ((table, chain), of `family`; one missing is
        skipped) refer to: the named counters they count into, the addresses they DNAT
        to (rule_refs.py). A dump per chain, which the kernel filters to that chain
        (~13 us each, whatever the table's size), where a dump of every counter walks
        the family's whole list for each message it fills."""
        self._check_home()
        found = RuleRefs()
        with self._lock:
            sock = self._netlink()
            for table, chain in chains:
                try:
                    for data, start, end in sock.dump_messages(
                            NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETRULE,
                            wire.rule_dump_request(family, table, chain)):
                        found.add_rule(family, table, data, start, end)
                except NetlinkError as exc:
                    if exc.errno != errno.ENOENT:
                        raise NftError(f"nf_tables netlink dump of {table} {chain}'s "
                                       f"rules: {exc}") from exc
                except OSError as exc:
                    raise NftError(f"nf_tables netlink dump of {table} {chain}'s "
                                   f"rules: {exc}") from exc
        return found

    def _run_child(self, text: str) -> None:
        cmd = [NFT, "-f", "-"]
        try:
            result = processes.run_recorded(cmd, text)
        except subprocess.TimeoutExpired as exc:
            raise NftError(f"nft -f - took over {exc.timeout:.0f} s and was killed; whether "
                           "the kernel took the transaction is unknown") from exc
        except (OSError, subprocess.SubprocessError) as exc:
            raise NftError(f"nft -f -: {exc}") from exc
        if result.returncode != 0:
            raise parse_error(result.stderr, text)

    def list_json(self, command: str) -> dict[str, Any]:
        """nft's JSON answer to `command` ("list table ip sliceproxy", "list chains ip6",
        ...), parsed. NftError when nft refuses it (a table that does not exist...)."""
        self._check_home()
        with self._lock:
            ctx = self._context()
            lib = _library()
            flags = lib.nft_ctx_output_get_flags(ctx)
            # Only for this command: with JSON output set, nft also parses files as JSON.
            lib.nft_ctx_output_set_flags(ctx, flags | _OUTPUT_JSON)
            try:
                rc = lib.nft_run_cmd_from_buffer(ctx, command.encode())
            finally:
                lib.nft_ctx_output_set_flags(ctx, flags)
            output = _buffer(lib.nft_ctx_get_output_buffer(ctx))
            errors = _buffer(lib.nft_ctx_get_error_buffer(ctx))
        if rc != 0:
            raise NftError(f"{command}: {parse_error(errors, command)}")
        try:
            parsed = json.loads(output)
        except ValueError as exc:
            raise NftError(f"{command}: nft's JSON does not parse: {exc}") from exc
        if not isinstance(parsed, dict):
            raise NftError(f"{command}: nft's JSON is not an object")
        return parsed

    def started_here(self, pid: int) -> bool:
        """`pid` (as a NEWGEN announcement names it) is ours: this process, a thread that
        commits in-process, or a recent `nft`/iptables-restore child."""
        return processes.started_here(pid)

    def close(self) -> None:
        """Free the libnftables context (no kernel access; any thread may call it). The
        runner stays bound to its thread and namespace and makes a new one if used."""
        with self._lock:
            if self._ctx is not None:
                _library().nft_ctx_free(self._ctx)
                self._ctx = None
                processes.forget_thread(self._tid)
            if self._socket is not None:
                self._socket.close()
                self._socket = None
                processes.forget_thread(self._socket_tid)
