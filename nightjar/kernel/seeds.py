"""One root seed -> independent, reproducible seeds per actor and per request (no global RNG)."""
from __future__ import annotations

import hashlib


def derive_seed(root: int, *names: object) -> int:
    """A 63-bit seed derived from the root and a path of names (stable across runs and platforms)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(str(root).encode())
    for n in names:
        h.update(b"/" + str(n).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def request_seed(root: int, req_id: int, seed: int | None, stream: str) -> int:
    """Seed of one request's sampler stream ("target" or "draft"); a user seed makes it reproducible."""
    base = seed if seed is not None else derive_seed(root, "request", req_id)
    return derive_seed(base, stream)
