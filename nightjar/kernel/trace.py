"""Event traces: every bus envelope, length-prefixed msgpack with a CRC per frame (no torch).

File layout (one *part*)::

    MAGIC (8 bytes)
    frame(header)  frame(envelope) ... frame(envelope)  frame(footer)

    frame = <u32 LE word> <u32 LE crc32> <payload>
        word bits 0..30: payload length; bit 31: control frame (header/footer, a msgpack map)
        crc32 covers the 4 length bytes and the payload, so one flipped bit anywhere is caught.

Envelope payloads are ``msgspec.msgpack`` of :class:`~nightjar.kernel.bus.Envelope` (the ``BusMsg``
union is tagged by ``type``). The header records ``schema_version`` and a hash of
``msgspec.json.schema(BusMsg)``: a reader refuses a newer version, and a different hash unless told
``allow_schema_drift`` (new fields get defaults, so an older trace usually still decodes).

Rotation: once a part holds ``max_bytes``, the writer ends it with a footer ``{"next": True}`` and
starts ``path.1``, ``path.2``... Every part is self-contained (magic + header with ``part`` and the
run's ``run_id``); a reader given ``path`` follows the chain. A clean ``close()`` writes a final
footer, so a file cut at a frame boundary is still reported as truncated.
"""
from __future__ import annotations

import functools
import hashlib
import io
import os
import struct
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import msgspec

from nightjar.kernel.bus import Envelope
from nightjar.kernel.messages import BusMsg

MAGIC = b"NJTRACE\x00"
SCHEMA_VERSION = 1
_FRAME = struct.Struct("<II")
_CONTROL = 1 << 31
_LEN_MASK = _CONTROL - 1
_FLUSH_BYTES = 1 << 20


class TraceError(Exception):
    """A trace cannot be read (bad magic, newer schema, truncated, corrupted frame)."""


@functools.lru_cache(maxsize=1)
def schema_hash() -> str:
    """sha256 (hex, 16 chars) of the JSON schema of ``BusMsg``: changes whenever a message changes."""
    schema = msgspec.json.schema(BusMsg)
    return hashlib.sha256(msgspec.json.encode(schema, order="sorted")).hexdigest()[:16]


def git_revision() -> str | None:
    """The repository's HEAD (with ``-dirty``), or None outside a checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() or None if rev.returncode == 0 else None


def part_path(path: str | os.PathLike, part: int) -> Path:
    """``path`` for part 0, ``path.N`` after that."""
    return Path(path) if part == 0 else Path(f"{os.fspath(path)}.{part}")


# ---- writing ----------------------------------------------------------------------------------------
class TraceWriter:
    """Tap for ``Bus.add_tap``: ``write(env)`` appends one frame to a buffered file.

    Cost (2-vCPU Xeon, measured by tests/kernel/test_trace.py): ~2-3 µs per envelope.
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any] | None = None,
                 max_bytes: int | None = 1 << 30) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._enc = msgspec.msgpack.Encoder()
        self._scratch = bytearray(256)
        self.header = self._make_header(dict(header or {}))
        self.part = 0
        self.num_envelopes = 0
        self.last_seq = 0
        self._file: io.BufferedWriter | None = None
        self._open_part()

    @staticmethod
    def _make_header(extra: dict[str, Any]) -> dict[str, Any]:
        cfg = extra.get("config") or {}
        head = {"magic": "nightjar-trace", "schema_version": SCHEMA_VERSION, "schema_hash": schema_hash(),
                "run_id": os.urandom(8).hex(), "created": time.time(), "seed": cfg.get("seed"),
                "git": git_revision()}
        head.update(extra)
        return head

    def _open_part(self) -> None:
        p = part_path(self.path, self.part)
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(p, "wb", buffering=_FLUSH_BYTES)
        self._file.write(MAGIC)
        self._bytes = len(MAGIC)
        self._control({**self.header, "part": self.part, "first_seq": self.last_seq + 1})

    def _control(self, obj: dict) -> None:
        payload = msgspec.msgpack.encode(obj, enc_hook=str)    # e.g. torch.__version__ is a str subclass
        word = struct.pack("<I", len(payload) | _CONTROL)
        self._file.write(word + struct.pack("<I", zlib.crc32(payload, zlib.crc32(word))) + payload)
        self._bytes += 8 + len(payload)

    def write(self, env: Envelope) -> None:
        buf = self._scratch
        self._enc.encode_into(env, buf, 8)
        n = len(buf) - 8
        struct.pack_into("<I", buf, 0, n)
        struct.pack_into("<I", buf, 4, zlib.crc32(buf[8:], zlib.crc32(buf[:4])))
        self._file.write(buf)
        self._bytes += n + 8
        self.num_envelopes += 1
        self.last_seq = env.seq
        if self.max_bytes is not None and self._bytes >= self.max_bytes:
            self._control({"end": True, "next": True, "last_seq": self.last_seq})
            self._file.close()
            self.part += 1
            self._open_part()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, handled: dict[str, int] | None = None) -> None:
        """Write the footer and close. ``handled``: per actor, the seq of the last envelope it handled
        (lets replay ignore envelopes that were still queued when the engine stopped)."""
        if self._file is None:
            return
        foot = {"end": True, "next": False, "last_seq": self.last_seq, "num_envelopes": self.num_envelopes}
        if handled is not None:
            foot["handled"] = dict(handled)
        self._control(foot)
        self._file.close()
        self._file = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- reading ----------------------------------------------------------------------------------------
class TraceReader:
    """Iterate a trace's envelopes (all parts, in order). ``header`` and ``footer`` are dicts.

    Raises :class:`TraceError` on a bad magic, a newer ``schema_version``, a different schema hash
    (unless ``allow_schema_drift``), a truncated file (unless ``allow_truncated``: then iteration stops
    at the last whole frame and ``truncated`` is set), or a frame whose CRC does not match.
    """

    def __init__(self, path: str | os.PathLike, *, allow_schema_drift: bool = False,
                 allow_truncated: bool = False) -> None:
        self.path = Path(path)
        self.allow_schema_drift, self.allow_truncated = allow_schema_drift, allow_truncated
        self._dec = msgspec.msgpack.Decoder(Envelope)
        self.footer: dict | None = None
        self.truncated = False
        self.schema_drift = False
        with open(self.path, "rb") as f:
            self.header = self._read_header(f, self.path)

    def _read_header(self, f, p: Path) -> dict:
        magic = f.read(len(MAGIC))
        if magic != MAGIC:
            raise TraceError(f"{p}: not a nightjar trace (bad magic {magic[:8]!r})")
        frame = self._frame(f, p)
        if frame is None or not frame[0]:
            raise TraceError(f"{p}: truncated or missing header")
        try:
            head = msgspec.msgpack.decode(frame[1])
        except msgspec.DecodeError as e:
            raise TraceError(f"{p}: unreadable header: {e}") from None
        if not isinstance(head, dict) or head.get("magic") != "nightjar-trace":
            raise TraceError(f"{p}: header is not a nightjar trace header")
        v = head.get("schema_version")
        if not isinstance(v, int) or v > SCHEMA_VERSION:
            raise TraceError(f"{p}: trace schema_version {v!r} is newer than this reader's {SCHEMA_VERSION}; "
                             f"upgrade nightjar to read it")
        if head.get("schema_hash") != schema_hash():
            self.schema_drift = True
            if not self.allow_schema_drift:
                raise TraceError(f"{p}: message schema differs from this build's (trace {head.get('schema_hash')}, "
                                 f"build {schema_hash()}); pass allow_schema_drift / --allow-schema-drift "
                                 "to try anyway")
        return head

    def _frame(self, f, p: Path) -> tuple[bool, bytes] | None:
        """(is_control, payload), or None at a clean end of file."""
        pos = f.tell()
        head = f.read(8)
        if not head:
            return None
        if len(head) < 8:
            return self._truncated(p, pos)
        word, crc = _FRAME.unpack(head)
        n = word & _LEN_MASK
        payload = f.read(n)
        if len(payload) < n:          # cut short (or a corrupted length that runs past the end)
            return self._truncated(p, pos)
        if zlib.crc32(payload, zlib.crc32(head[:4])) != crc:
            raise TraceError(f"{p}: corrupted frame at byte {pos} (CRC mismatch)")
        return bool(word & _CONTROL), payload

    def _truncated(self, p: Path, pos: int):
        if self.allow_truncated:
            self.truncated = True
            return None
        raise TraceError(f"{p}: truncated at byte {pos} (no end-of-trace footer); "
                         "the recording stopped abruptly (pass allow_truncated / --allow-truncated to read "
                         "the prefix)")

    def __iter__(self) -> Iterator[Envelope]:
        part = 0
        while True:
            p = part_path(self.path, part)
            try:
                f = open(p, "rb")
            except FileNotFoundError:
                raise TraceError(f"{p}: missing trace part {part} (the previous part says it continues)") from None
            with f:
                head = self._read_header(f, p)
                if head.get("run_id") != self.header.get("run_id") or head.get("part") != part:
                    raise TraceError(f"{p}: part {head.get('part')} of run {head.get('run_id')} does not continue "
                                     f"run {self.header.get('run_id')} (stale rotated file?)")
                foot = yield from self._envelopes(f, p)
            if foot is None:          # truncated and allowed
                return
            self.footer = foot
            if not foot.get("next"):
                return
            part += 1

    def _envelopes(self, f, p: Path):
        dec = self._dec
        while True:
            pos = f.tell()
            frame = self._frame(f, p)
            if frame is None:
                if self.truncated:
                    return None
                return self._truncated(p, pos)
            control, payload = frame
            if control:
                foot = msgspec.msgpack.decode(payload)
                if not isinstance(foot, dict) or not foot.get("end"):
                    raise TraceError(f"{p}: unexpected control frame at byte {pos}")
                return foot
            try:
                yield dec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise TraceError(f"{p}: undecodable envelope at byte {pos}: {e}") from None

    def envelopes(self) -> list[Envelope]:
        return list(self)


def read_trace(path: str | os.PathLike, **kw) -> tuple[dict, list[Envelope], dict | None]:
    """(header, envelopes, footer) of a whole trace."""
    r = TraceReader(path, **kw)
    envs = list(r)
    return r.header, envs, r.footer
