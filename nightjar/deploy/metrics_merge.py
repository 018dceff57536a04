"""Merge several replicas' Prometheus text expositions into one, each sample labelled ``replica="<id>"``.

Families stay contiguous (one ``# HELP`` / ``# TYPE`` each, then every replica's samples), as the text
format asks. Pure text processing: no Ray, no prometheus_client.
"""
from __future__ import annotations


def _families(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """``{family: (comment lines, sample lines)}`` in the order the exposition lists them."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                current = out.setdefault(parts[2], ([], []))
                if line not in current[0]:
                    current[0].append(line)
            continue
        if current is None:
            current = out.setdefault(line.split("{", 1)[0].split(" ", 1)[0], ([], []))
        current[1].append(line)
    return out


def _label(sample: str, replica: str) -> str:
    label = f'replica="{replica}"'
    name_end = min((i for i in (sample.find("{"), sample.find(" ")) if i >= 0), default=len(sample))
    if sample[name_end:name_end + 1] == "{":
        rest = sample[name_end + 1:]
        sep = "" if rest.startswith("}") else ","
        return f"{sample[:name_end]}{{{label}{sep}{rest}"
    return f"{sample[:name_end]}{{{label}}}{sample[name_end:]}"


def merge_replica_metrics(texts: dict[str, str]) -> str:
    """One exposition from ``{replica id: that replica's exposition}``."""
    merged: dict[str, tuple[list[str], list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family, (comments, samples) in _families(text).items():
            into = merged.setdefault(family, ([], []))
            into[0].extend(c for c in comments if c not in into[0])
            into[1].extend(_label(s, replica) for s in samples)
    lines: list[str] = []
    for comments, samples in merged.values():
        lines += comments + samples
    return "\n".join(lines) + "\n" if lines else ""
