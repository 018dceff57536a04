"""Teacher-forced text for the draft head: the Python documentation as chat answers.

    python -m nightjar.training.texts --rst DIR --out answers.jsonl [--tokens 1000000] [--seed 0]

The head learns the target's next-token distribution at every answer position; a position costs one
teacher-forced forward of the target (1.5-3x cheaper than generating it here), so text written by people adds training
signal faster than the target's own answers do, if what the target predicts on it is worth learning. The source
is the reStructuredText of Python's documentation (Debian's ``python3.11-doc``, PSF licence; its
``html/_sources`` directory, "What's new" and the C API left out): each section and each documented function,
class or method becomes one record, the user asking about it (a question from a few templates), the cleaned text
as the answer (roles and directives gone, code in fenced blocks, each prose paragraph on one line as the target
writes), cut at ``--max-answer`` tokens. Records go in a seeded order until ``--tokens`` answer tokens and are
appended to the corpus the answers' generator writes ({"id": "doc-<crc32 of file, place, title>", "variant":
"text", "prompt_ids", "answer_ids"}; records it holds already are skipped, so a rerun adds nothing).
``eagle.py`` trains on them beside the answers, never validates on them and draws its vocabulary from the
answers alone.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import zlib
from pathlib import Path

OBJECTS = ("function", "method", "class", "data", "attribute", "exception", "decorator", "classmethod",
           "staticmethod", "opcode", "decoratormethod", "coroutinefunction", "coroutinemethod", "abstractmethod",
           "awaitablefunction", "awaitablemethod", "cmdoption", "envvar", "describe", "pdbcommand", "option")
MEMBERS = ("method", "attribute", "classmethod", "staticmethod", "decoratormethod", "coroutinemethod",
           "abstractmethod", "awaitablemethod")
MODULE_LEVEL = ("function", "class", "exception", "data", "decorator", "coroutinefunction", "awaitablefunction")
CODE = ("code-block", "doctest", "testcode", "testoutput", "sourcecode", "code", "parsed-literal", "productionlist")
ADMONITION = {"note": "Note:", "warning": "Warning:", "seealso": "See also:", "versionadded": "New in version",
              "versionchanged": "Changed in version", "deprecated": "Deprecated since version", "tip": "Tip:",
              "important": "Important:", "caution": "Caution:", "attention": "Attention:", "hint": "Hint:",
              "deprecated-removed": "Deprecated since version", "impl-detail": "CPython implementation detail:",
              "glossary": "", "topic": "", "only": "", "container": ""}     # "": the body without a label
CODE_ROLES = {"func", "meth", "class", "mod", "data", "attr", "exc", "const", "keyword", "obj", "file", "samp",
              "option", "envvar", "program", "c:func", "c:type", "c:macro", "c:data", "c:member", "py:func",
              "py:meth", "py:class", "py:mod", "py:data", "py:attr", "py:exc", "py:const", "opcode", "kbd", "command"}
HEADING = re.compile(r"^([=\-~^*#\"'+`:.])\1{2,}\s*$")
DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::\s*(.*)$")
LABEL = re.compile(r"^\.\.\s+_([^:`]+):\s*$")
ROLE = re.compile(r":([\w:+-]+):`([^`]+)`")
LIST_ITEM = re.compile(r"^([-*+]|\d+[.)]|#\.)\s")
GRID = re.compile(r"^(\+[-=+]+\+|=+( +=+)+)\s*$")         # grid and simple table borders
KEEP = (" ", "\t", "|", "```", ">>>", "...", ":")            # lines reflow leaves as they are
QUESTIONS = {"section": ("Explain {t} in Python.", "Tell me about {t}.", "What should I know about {t}?",
                         "Can you describe {t} for a Python programmer?"),
             "object": ("What does `{t}` do in Python?", "Explain `{t}`.", "How do I use `{t}`?",
                        "Describe `{t}` from the Python standard library.")}


def _role(m: re.Match, labels: dict) -> str:
    role, text = m.group(1), m.group(2).lstrip("!")
    if text.startswith("~") and role != "file":          # ~a.b.c shows as c
        text = text[1:].split(".")[-1]
    if "<" in text and text.endswith(">"):
        text = text[: text.rindex("<")].strip() or text
    elif role == "ref":                                  # a bare label shows its section's title
        text = labels.get(text.lower(), text.replace("-", " ").replace("_", " "))
    if role in ("pep", "rfc"):
        return f"{role.upper()} {text}"
    return f"`{text}`" if role in CODE_ROLES else text


def clean_inline(text: str, labels: dict | None = None) -> str:
    """Inline reST -> Markdown-ish text: roles lose their names, ``literals`` get one backtick pair,
    `link <url>`_ and `name`_ keep their titles (a role or literal may span lines)."""
    line = ROLE.sub(lambda m: _role(m, labels or {}), text)
    line = re.sub(r"(?<!`)``((?:[^`\n]|\n(?!\n))+?)``(?!`)", r"`\1`", line)
    line = re.sub(r"`([^`<]+?)\s*<[^`>]+>`__?", r"\1", line)
    line = re.sub(r"`([^`]+)`__?(?!\w)", r"\1", line)
    line = re.sub(r"\s*\[#?[\w-]*\]_", "", line).replace("\\ ", "")
    return re.sub(r"\|([\w-]+)\|", r"\1", line).replace(" --- ", " - ")


def _clean_prose(lines: list[str], labels: dict) -> str:
    """``clean_inline`` on the text outside code fences; the code as it is."""
    out, prose, fence = [], [], False
    for line in lines + ["```"]:
        if line.startswith("```"):
            if not fence:
                out.append(clean_inline("\n".join(prose), labels))
                prose = []
            fence = not fence
            out.append(line)
        elif fence:
            out.append(line)
        else:
            prose.append(line)
    return "\n".join(out[:-1])


def reflow(text: str) -> str:
    """Joins the hard-wrapped lines of each prose paragraph into one (as the target writes); code fences,
    indented lines, doctest lines, list items and table rows keep their lines."""
    out, fence = [], False
    for line in text.split("\n"):
        keep = fence or not line.strip() or line.startswith(KEEP) or LIST_ITEM.match(line)
        if line.startswith("```"):
            fence = not fence
        if not keep and out and out[-1].strip() and not out[-1].startswith(KEEP) and not out[-1].endswith(":"):
            out[-1] = out[-1].rstrip() + " " + line.strip()
        else:
            out.append(line)
    return "\n".join(out)


def _indented_block(lines: list[str], i: int) -> tuple[list[str], int]:
    """The block indented under line ``i - 1``, starting at ``i`` (blank lines inside kept), dedented."""
    block, j = [], i
    while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
        block.append(lines[j])
        j += 1
    while block and not block[-1].strip():
        block.pop()
    pad = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
    return [b[pad:] for b in block], j


def _heading_at(lines: list[str], i: int) -> str | None:
    """The title of a heading that starts at line ``i`` (over- and underlined, or underlined), else None."""
    line, nxt = lines[i], lines[i + 1] if i + 1 < len(lines) else ""
    if HEADING.match(line) and i + 2 < len(lines) and HEADING.match(lines[i + 2]) and line[0] == lines[i + 2][0]:
        return nxt
    if line.strip() and not line.startswith((" ", "..")) and HEADING.match(nxt) and len(nxt.strip()) >= 3:
        return line
    return None


def section_labels(text: str) -> dict:
    """{label: title} for the ``.. _label:`` lines of a reST file that stand right before a heading."""
    lines, out = text.splitlines(), {}
    for i, line in enumerate(lines):
        m = LABEL.match(line)
        j = i + 1
        while m and j < len(lines) and (not lines[j].strip() or LABEL.match(lines[j])):
            j += 1
        title = _heading_at(lines, j) if m and j < len(lines) else None
        if title:
            out[m.group(1).strip().lower()] = clean_inline(title).strip()
    return out


def _object_title(base: str, arg: str, module: str, klass: str) -> str:
    title = re.sub(r"\s+", " ", arg.strip())
    name = title.split("(")[0]
    if base in MEMBERS and klass and "." not in name:
        return f"{klass}.{title}"
    if module and base in MODULE_LEVEL and not name.startswith(module + "."):
        return f"{module}.{title}"
    return title


def units(text: str, source: str, labels: dict | None = None) -> list[dict]:
    """Sections and documented objects of one reST file as {"kind", "title", "body", "source"}, in order.
    A directive's body that holds text (an object's description, a note) is read as text, nested directives
    and literal blocks included; ``labels`` (``section_labels``) name the sections bare :ref: roles point at."""
    lines, out, cur, module, klass = text.splitlines(), [], None, "", ""
    i = 0

    def start(kind, title):
        nonlocal cur
        cur = {"kind": kind, "title": title.strip(), "lines": [], "source": source}
        out.append(cur)

    while i < len(lines):
        line = lines[i]
        title = _heading_at(lines, i)
        if title is not None:
            start("section", clean_inline(title, labels))
            klass = ""
            i += 3 if HEADING.match(line) else 2
            continue
        indent = len(line) - len(line.lstrip())
        if indent and (line.lstrip().startswith(".. ") or line.rstrip().endswith("::")):
            j = i + 1                                   # a directive or literal block inside a list item or quote:
            while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
                j += 1                                  # read at column 0
            lines[i:j] = [b[indent:] if b.strip() else "" for b in lines[i:j]] + [""]
            continue
        d = DIRECTIVE.match(line)
        if d:
            name, arg = d.group(1), d.group(2)
            base = name.split(":")[-1]
            block, j = _indented_block(lines, i + 1)
            if base in ("module", "currentmodule"):
                module, klass = arg.strip(), ""
            if base in OBJECTS and not name.startswith("c:"):
                while arg.rstrip().endswith("\\") and block:  # a signature continued on the next lines
                    arg = arg.rstrip()[:-1] + " " + block.pop(0).strip()
                while block and block[0].strip():          # more signatures, the directive's options
                    block.pop(0)
                title = _object_title(base, arg, module, klass)
                if base in ("class", "exception"):
                    klass = title.split("(")[0]
                elif base in MODULE_LEVEL:
                    klass = ""
                start("object", title)
                lines[i + 1: j] = block + [""]              # its body, read as text
                i += 1
                continue
            if cur is not None and base in CODE:
                while block and (not block[0].strip() or re.match(r"^:[\w-]+:", block[0])):
                    block.pop(0)                             # options, blank lines
                cur["lines"] += ["", "```"] + block + ["```", ""]
            elif cur is not None and base in ADMONITION:
                while block and not block[0].strip():
                    block.pop(0)
                label = f"{ADMONITION[base]} {arg}".strip() if ADMONITION[base] else ""   # glossary, topic: none
                if label:
                    cur["lines"] += ["", label + ("" if label.endswith(":") else ":" if block else ".")]
                lines[i + 1: j] = block + [""]              # its body, read as text
                i += 1
                continue
            i = j
            continue
        if line.startswith(".. "):                    # comments, labels, substitutions
            _, i = _indented_block(lines, i + 1)
            continue
        if cur is not None:
            if line.rstrip().endswith("::"):
                head = line.rstrip()[:-2].rstrip()
                block, j = _indented_block(lines, i + 1)
                while block and not block[0].strip():
                    block.pop(0)
                if head:
                    cur["lines"].append(head + ":")
                cur["lines"] += ["", "```"] + block + ["```", ""] if block else []
                i = j
                continue
            if not HEADING.match(line) and not GRID.match(line.strip()):   # transitions, table borders
                cur["lines"].append(line)
        i += 1
    for u in out:
        u["body"] = re.sub(r"\n{3,}", "\n\n", reflow(_clean_prose(u.pop("lines"), labels or {})).strip())
    return [u for u in out if u["body"]]


def question(u: dict, seed: int) -> str:
    forms = QUESTIONS[u["kind"]]
    key = zlib.crc32(f"{seed}:{u['source']}:{u['title']}".encode())
    return forms[key % len(forms)].format(t=u["title"])


def _record_id(source: str, k: int, u: dict) -> str:
    """Stable across seeds and budgets: the file, the unit's place in it and its title."""
    key = f"{source}#{k}:{u['title']}"
    return f"doc-{zlib.crc32(key.encode()):08x}"


def text_records(rst_dir: Path, tokenizer, tokens: int, seed: int = 0, max_answer: int = 384,
                 min_answer: int = 48) -> list[dict]:
    """Records of the documentation's units in a seeded order until ``tokens`` answer tokens."""
    files = sorted(p for p in rst_dir.rglob("*.txt") if "whatsnew" not in p.parts and "c-api" not in p.parts)
    texts = {str(p.relative_to(rst_dir)): p.read_text(errors="replace") for p in files}
    labels = {k: v for t in texts.values() for k, v in section_labels(t).items()}
    every = [(_record_id(src, k, u), u) for src, t in texts.items() for k, u in enumerate(units(t, src, labels))]
    random.Random(seed).shuffle(every)
    out, total, seen = [], 0, set()
    for rid, u in every:
        if total >= tokens:
            break
        ans = tokenizer.encode(u["body"])[:max_answer]
        if len(ans) < min_answer or rid in seen:
            continue
        seen.add(rid)
        prompt = tokenizer.encode_chat([{"role": "user", "content": question(u, seed)}])
        out.append({"id": rid, "variant": "text", "prompt_ids": prompt, "answer_ids": ans})
        total += len(ans)
    return out


def main(argv=None) -> None:
    from nightjar.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rst", required=True, help="directory of .rst.txt sources (python3.11-doc: html/_sources)")
    ap.add_argument("--out", required=True, help="the corpus JSONL to append to (records it holds are skipped)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="answer tokens to write")
    ap.add_argument("--max-answer", type=int, default=384)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not Path(a.rst).is_dir():
        ap.error(f"--rst {a.rst}: not a directory")
    if Path(a.out).is_dir():
        ap.error(f"--out {a.out}: a directory, not the corpus file")
    if a.tokens < 1 or a.max_answer < 1:
        ap.error("--tokens and --max-answer must be >= 1")
    recs = text_records(Path(a.rst), load_model(a.model, pack=False).tokenizer, a.tokens, a.seed, a.max_answer)
    try:
        added = append_records(Path(a.out), recs)
    except ValueError as e:
        ap.error(str(e))
    print(f"{len(recs)} text records, {sum(len(r['answer_ids']) for r in recs)} answer tokens; {added} appended to "
          f"{a.out} (the rest were there)", file=sys.stderr)


def append_records(path: Path, recs: list[dict]) -> int:
    """Appends to the corpus at ``path`` the records whose (id, variant) it does not hold yet, in one write;
    returns how many. A corpus whose last line is unfinished (its writer still running, or stopped inside a
    write) is left as it is: ValueError."""
    text = path.read_text() if path.exists() else ""
    if text and not text.endswith("\n"):
        raise ValueError(f"{path}: its last line is unfinished (the answers' generator still writing, or stopped "
                         "inside a write: its rerun cuts the line and generates that chunk again)")
    have = {(r["id"], r["variant"]) for r in (json.loads(x) for x in text.splitlines() if x.strip())}
    new = [r for r in recs if (r["id"], r["variant"]) not in have]
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in new))
    return len(new)


if __name__ == "__main__":
    main()
