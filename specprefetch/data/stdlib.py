"""Corpus text from the Python standard library's own source: code chunks and documentation prose.

``stdlib_code``: each documented function or method becomes a HumanEval-shaped sample (prompt = signature and
docstring, reference = the body). ``stdlib_docs``: module and class docstrings, long function docstrings, and
comment blocks (prompt = the code they explain) as prose. Files are listed in sorted order and visited in a
seeded permutation, a few items per file per pass, so the corpus is varied and deterministic for a given
Python version. Anything that could overlap HumanEval is excluded: functions named like a HumanEval entry
point, and chunks sharing a non-trivial line with any HumanEval prompt or solution.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sys
import sysconfig
import textwrap
import tokenize
from collections.abc import Iterator
from pathlib import Path

from specprefetch.data.draft import Draft

EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
                  "ensurepip", "pydoc_data", "turtledemo", "__phello__"}
MAX_FILE_BYTES = 400_000
PER_FILE = 3
MIN_SHARED_LINE = 25  # characters: shorter lines ("return result") are too generic to signal overlap
CODE_MAX_LINES, CODE_MAX_CHARS, PROMPT_MAX_CHARS = 60, 2500, 1500
DOC_MIN_CHARS, DOC_MAX_CHARS = 80, 2000


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[str, ...]:
    """Relative POSIX paths of the stdlib's .py files (tests, vendored and generated data excluded), sorted."""
    root = stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDED_PARTS & set(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        if any(part.startswith("test_") for part in rel.parts) or not p.is_file():
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(rel.as_posix())
    return tuple(sorted(out))


def _norm(line: str) -> str:
    return " ".join(line.split())


@functools.lru_cache(maxsize=1)
def humaneval_fingerprint() -> tuple[frozenset[str], frozenset[str]]:
    """(entry-point names, normalised non-trivial lines) of all 164 HumanEval problems."""
    from specprefetch.data.humaneval import load_problems

    names, lines = set(), set()
    for p in load_problems():
        names.add(p["entry_point"])
        for text in (p["prompt"], p["canonical_solution"]):
            for line in text.splitlines():
                n = _norm(line)
                if len(n) >= MIN_SHARED_LINE:
                    lines.add(n)
    return frozenset(names), frozenset(lines)


def overlaps_humaneval(text: str, defined: str | None = None) -> bool:
    names, lines = humaneval_fingerprint()
    if defined is not None and defined in names:
        return True
    return any(_norm(line) in lines for line in text.splitlines() if len(_norm(line)) >= MIN_SHARED_LINE)


def module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def _read(rel: str) -> str | None:
    try:
        with tokenize.open(stdlib_root() / rel) as f:  # honours the file's encoding cookie
            return f.read()
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _strip_indent(lines: list[str], indent: int) -> list[str]:
    return [ln[indent:] if ln[:indent].strip() == "" else ln.lstrip() for ln in lines]


def _walk_defs(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """(qualname, node) of every function and class, in source order."""
    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                q = f"{prefix}{child.name}"
                yield q, child
                yield from visit(child, q + ".")
    yield from visit(tree, "")


@functools.lru_cache(maxsize=None)
def file_items(rel: str) -> tuple[tuple[Draft, ...], tuple[Draft, ...]]:
    """(code drafts, docs drafts) of one stdlib file, in source order."""
    text = _read(rel)
    if text is None:
        return (), ()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return (), ()
    lines = text.splitlines()
    mod = module_name(rel)
    src = f"stdlib {rel} python={sys.version.split()[0]}"
    code: list[Draft] = []
    docs: list[Draft] = []
    mdoc = ast.get_docstring(tree)
    if mdoc and DOC_MIN_CHARS <= len(mdoc) <= DOC_MAX_CHARS and not overlaps_humaneval(mdoc):
        docs.append(Draft(prompt=f"Describe the purpose of the Python standard library module `{mod}`.",
                          reference=mdoc, meta={"kind": "module_docstring", "module": mod, "source": src}))
    for qual, node in _walk_defs(tree):
        doc = ast.get_docstring(node)
        if not doc:
            continue
        if isinstance(node, ast.ClassDef):
            if DOC_MIN_CHARS <= len(doc) <= DOC_MAX_CHARS and not overlaps_humaneval(doc, node.name):
                docs.append(Draft(prompt=f"What does the class `{mod}.{qual}` do?", reference=doc,
                                  meta={"kind": "class_docstring", "module": mod, "qualname": qual, "source": src}))
            continue
        item = _function_chunk(node, lines, mod, qual, src)
        if item is not None:
            code.append(item)
        elif DOC_MIN_CHARS <= len(doc) <= DOC_MAX_CHARS and not overlaps_humaneval(doc, node.name):
            docs.append(Draft(prompt=f"What does `{mod}.{qual}` do?", reference=doc,
                              meta={"kind": "function_docstring", "module": mod, "qualname": qual, "source": src}))
    docs.extend(_comment_blocks(lines, mod, src))
    return tuple(code), tuple(docs)


def _function_chunk(node: ast.AST, lines: list[str], mod: str, qual: str, src: str) -> Draft | None:
    """Signature + docstring as prompt, the rest of the body as reference (HumanEval's shape)."""
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    if node.name in humaneval_fingerprint()[0] or len(node.body) < 2:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    doc_end = node.body[0].end_lineno
    end = node.end_lineno
    if doc_end is None or end is None or end - doc_end < 2 or end - doc_end > CODE_MAX_LINES:
        return None
    indent = node.col_offset
    prompt = "\n".join(_strip_indent(lines[start:doc_end], indent)) + "\n"
    reference = "\n".join(_strip_indent(lines[doc_end:end], indent)) + "\n"
    if len(prompt) > PROMPT_MAX_CHARS or len(reference) > CODE_MAX_CHARS or not reference.strip():
        return None
    if overlaps_humaneval(prompt + reference):
        return None
    return Draft(prompt=prompt, reference=reference,
                 meta={"kind": "function", "module": mod, "qualname": qual, "lineno": start + 1, "source": src})


COMMENT = re.compile(r"^\s*#(?!!)\s?(.*)$")


def _comment_blocks(lines: list[str], mod: str, src: str) -> list[Draft]:
    """Runs of >= 3 full-line comments followed by code: prompt = that code, reference = the comment prose."""
    out: list[Draft] = []
    i = 0
    while i < len(lines):
        j = i
        while j < len(lines) and COMMENT.match(lines[j]):
            j += 1
        if j - i >= 3:
            prose = " ".join(COMMENT.match(ln).group(1).strip() for ln in lines[i:j]).strip()  # type: ignore[union-attr]
            code = []
            k = j
            while k < len(lines) and lines[k].strip() and len(code) < 6:
                code.append(lines[k])
                k += 1
            if DOC_MIN_CHARS <= len(prose) <= DOC_MAX_CHARS and code and re.search(r"[a-zA-Z]{3,} [a-zA-Z]{3,}", prose):
                indent = len(lines[i]) - len(lines[i].lstrip())
                snippet = textwrap.dedent("\n".join(_strip_indent(code, indent)))
                if not overlaps_humaneval(prose + "\n" + snippet):
                    out.append(Draft(
                        prompt=f"Write the comment that explains this code from `{mod}`:\n{snippet}\n",
                        reference=prose, meta={"kind": "comment", "module": mod, "lineno": i + 1, "source": src}))
            i = max(j, i + 1)
        else:
            i = j + 1 if j > i else i + 1
    return out


def stdlib_drafts(kind: str, n: int, seed: int) -> list[Draft]:
    """Up to ``n`` distinct drafts of ``kind`` ("stdlib_code" or "stdlib_docs"); fewer if the stdlib runs out."""
    if kind not in ("stdlib_code", "stdlib_docs"):
        raise ValueError(kind)
    slot = 0 if kind == "stdlib_code" else 1
    files = list(stdlib_files())
    random.Random(f"specprefetch/{kind}/{seed}").shuffle(files)
    taken: list[Draft] = []
    seen: set[tuple[str, str]] = set()
    rest: list[list[Draft]] = []

    def add(items: list[Draft]) -> None:
        for d in items:
            if len(taken) >= n:
                return
            key = (d.prompt, d.reference)
            if key not in seen:
                seen.add(key)
                taken.append(d)

    for rel in files:
        if len(taken) >= n:
            break
        items = list(file_items(rel)[slot])
        random.Random(f"specprefetch/{kind}/{seed}/{rel}").shuffle(items)
        add(items[:PER_FILE])
        rest.append(items[PER_FILE:])
    for items in rest:  # second pass: the remainder of every visited file
        if len(taken) >= n:
            break
        add(items)
    return taken
