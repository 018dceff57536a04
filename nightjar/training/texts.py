"""Teacher-forced text for the draft head: the Python documentation as chat answers.

    python -m nightjar.training.texts --rst DIR --out answers.jsonl [--tokens 1000000] [--seed 0]

The head learns the target's next-token distribution at every answer position; a position costs one
teacher-forced forward of the target (~3x cheaper than generating it), so text written by people adds training
signal faster than the target's own answers do, if what the target predicts on it is worth learning. The source
is the reStructuredText of Python's documentation (Debian's ``python3.11-doc``, PSF licence; its
``html/_sources`` directory, "What's new" and the C API left out): each section and each documented function,
class or method becomes one record, the user asking about it (a question from a few templates), the cleaned text
as the answer (roles and directives gone, code in fenced blocks, each prose paragraph on one line as the target
writes), cut at ``--max-answer`` tokens. Records go in a seeded order until ``--tokens`` answer tokens and are
appended to the corpus the answers' generator writes ({"id": "doc-N", "variant": "text", "prompt_ids",
"answer_ids"}; records it holds already are skipped, so a rerun adds nothing). ``eagle.py`` trains on them beside
the answers, never validates on them and draws its vocabulary from the answers alone.
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
           "staticmethod", "opcode", "decoratormethod", "coroutinefunction", "coroutinemethod", "abstractmethod")
CODE = ("code-block", "doctest", "testcode", "testoutput", "sourcecode", "code")
ADMONITION = {"note": "Note:", "warning": "Warning:", "seealso": "See also:", "versionadded": "New in version",
              "versionchanged": "Changed in version", "deprecated": "Deprecated since version", "tip": "Tip:",
              "important": "Important:", "caution": "Caution:", "attention": "Attention:", "hint": "Hint:",
              "deprecated-removed": "Deprecated since version"}
CODE_ROLES = {"func", "meth", "class", "mod", "data", "attr", "exc", "const", "keyword", "obj", "file", "samp",
              "option", "envvar", "program", "c:func", "c:type", "c:macro", "c:data", "c:member", "py:func",
              "py:meth", "py:class", "py:mod", "py:data", "py:attr", "py:exc", "py:const", "opcode", "kbd", "command"}
HEADING = re.compile(r"^([=\-~^*#\"'+`:.])\1{2,}\s*$")
DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::\s*(.*)$")
ROLE = re.compile(r":([\w:+-]+):`([^`]+)`")
LIST_ITEM = re.compile(r"^([-*+]|\d+[.)]|#\.)\s")
GRID = re.compile(r"^\+[-=+]+\+$")
QUESTIONS = {"section": ("Explain {t} in Python.", "Tell me about {t}.", "What should I know about {t}?",
                         "Can you describe {t} for a Python programmer?"),
             "object": ("What does `{t}` do in Python?", "Explain `{t}`.", "How do I use `{t}`?",
                        "Describe `{t}` from the Python standard library.")}


def _role(m: re.Match) -> str:
    role, text = m.group(1), m.group(2).lstrip("!")
    if text.startswith("~") and role != "file":          # ~a.b.c shows as c
        text = text[1:].split(".")[-1]
    if "<" in text and text.endswith(">"):
        text = text[: text.rindex("<")].strip() or text
    if role in ("pep", "rfc"):
        return f"{role.upper()} {text}"
    return f"`{text}`" if role in CODE_ROLES else text


def clean_inline(text: str) -> str:
    """Inline reST -> Markdown-ish text: roles lose their names, ``literals`` get one backtick pair,
    `link <url>`_ keeps its title (a role may span lines)."""
    line = ROLE.sub(_role, text)
    line = re.sub(r"(?<!`)``([^`\n]+)``(?!`)", r"`\1`", line)
    line = re.sub(r"`([^`<]+?)\s*<[^`>]+>`__?", r"\1", line)
    line = re.sub(r"\s*\[#?[\w-]*\]_", "", line)
    return re.sub(r"\|([\w-]+)\|", r"\1", line).replace(" --- ", " - ")


def reflow(text: str) -> str:
    """Joins the hard-wrapped lines of each prose paragraph into one (as the target writes); code fences,
    indented lines, list items and table rows keep their lines."""
    out, fence = [], False
    for line in text.split("\n"):
        keep = fence or not line.strip() or line.startswith((" ", "\t", "|", "```")) or LIST_ITEM.match(line)
        if line.startswith("```"):
            fence = not fence
        if not keep and out and out[-1].strip() and not out[-1].startswith(("```", " ", "\t", "|")) \
                and not out[-1].endswith(":"):
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


def units(text: str, source: str) -> list[dict]:
    """Sections and documented objects of one reST file as {"kind", "title", "body", "source"}, in order."""
    lines, out, cur, module = text.splitlines(), [], None, ""
    i = 0

    def start(kind, title):
        nonlocal cur
        cur = {"kind": kind, "title": title.strip(), "lines": [], "source": source}
        out.append(cur)

    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if HEADING.match(line) and i + 2 < len(lines) and HEADING.match(lines[i + 2]) and line[0] == lines[i + 2][0]:
            start("section", clean_inline(nxt))      # an overlined heading
            i += 3
            continue
        if line.strip() and not line.startswith((" ", "..")) and HEADING.match(nxt) and len(nxt.strip()) >= 3:
            start("section", clean_inline(line))
            i += 2
            continue
        d = DIRECTIVE.match(line)
        if d:
            name, arg = d.group(1), d.group(2)
            block, j = _indented_block(lines, i + 1)
            if name in ("module", "currentmodule"):
                module = arg.strip()
            if name.split(":")[-1] in OBJECTS and not name.startswith("c:"):
                while arg.rstrip().endswith("\\") and block:  # a signature continued on the next lines
                    arg = arg.rstrip()[:-1] + " " + block.pop(0).strip()
                title = re.sub(r"\s+", " ", arg.strip())
                if module and name.split(":")[-1] in ("function", "class", "exception", "data", "decorator") \
                        and not title.startswith(module + "."):
                    title = f"{module}.{title}"
                start("object", title)
                while block and re.match(r"^:[\w-]+:(\s|$)", block[0]):    # the directive's options
                    block.pop(0)
                lines[i + 1: j] = block                       # its body, read as text
                i += 1
                continue
            elif cur is not None and name in CODE:
                cur["lines"] += ["```"] + [b for b in block if not b.startswith(":")] + ["```"]
            elif cur is not None and name in ADMONITION:
                label = f"{ADMONITION[name]} {arg}".rstrip()
                cur["lines"] += [label if label.endswith(":") else label + ":"] + block
            i = j
            continue
        if line.startswith(".. "):                    # comments, labels, substitutions
            _, i = _indented_block(lines, i + 1)
            continue
        if cur is not None:
            if line.rstrip().endswith("::") and not line.startswith((" ", "\t")):
                head = line.rstrip()[:-2].rstrip()
                block, j = _indented_block(lines, i + 1)
                while block and not block[0].strip():
                    block.pop(0)
                if head:
                    cur["lines"].append(head + ":")
                cur["lines"] += ["", "```"] + block + ["```"] if block else []
                i = j
                continue
            if not HEADING.match(line) and not GRID.match(line.strip()):   # transitions, table borders
                cur["lines"].append(line)
        i += 1
    for u in out:
        u["body"] = re.sub(r"\n{3,}", "\n\n", reflow(clean_inline("\n".join(u.pop("lines")))).strip())
    return [u for u in out if u["body"]]


def question(u: dict, seed: int) -> str:
    forms = QUESTIONS[u["kind"]]
    key = zlib.crc32(f"{seed}:{u['source']}:{u['title']}".encode())
    return forms[key % len(forms)].format(t=u["title"])


def text_records(rst_dir: Path, tokenizer, tokens: int, seed: int = 0, max_answer: int = 384,
                 min_answer: int = 48) -> list[dict]:
    """Records of the documentation's units in a seeded order until ``tokens`` answer tokens."""
    files = sorted(p for p in rst_dir.rglob("*.txt") if "whatsnew" not in p.parts and "c-api" not in p.parts)
    every = [u for p in files for u in units(p.read_text(errors="replace"), str(p.relative_to(rst_dir)))]
    random.Random(seed).shuffle(every)
    out, total = [], 0
    for n, u in enumerate(every):
        if total >= tokens:
            break
        ans = tokenizer.encode(u["body"])[:max_answer]
        if len(ans) < min_answer:
            continue
        prompt = tokenizer.encode_chat([{"role": "user", "content": question(u, seed)}])
        out.append({"id": f"doc-{n:06d}", "variant": "text", "prompt_ids": prompt, "answer_ids": ans})
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
    if a.tokens < 1 or a.max_answer < 1:
        ap.error("--tokens and --max-answer must be >= 1")
    recs = text_records(Path(a.rst), load_model(a.model, pack=False).tokenizer, a.tokens, a.seed, a.max_answer)
    added = append_records(Path(a.out), recs)
    print(f"{len(recs)} text records, {sum(len(r['answer_ids']) for r in recs)} answer tokens; {added} appended to "
          f"{a.out} (the rest were there)", file=sys.stderr)


def append_records(path: Path, recs: list[dict]) -> int:
    """Appends to the corpus at ``path`` the records whose (id, variant) it does not hold yet, in one write
    (a line left unfinished by a stop is cut first); returns how many."""
    text = path.read_text() if path.exists() else ""
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        with path.open("r+") as f:
            f.truncate(len(text.encode()))
    have = {(r["id"], r["variant"]) for r in map(json.loads, text.splitlines()) if r}
    new = [r for r in recs if (r["id"], r["variant"]) not in have]
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in new))
    return len(new)


if __name__ == "__main__":
    main()
