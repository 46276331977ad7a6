#!/usr/bin/env python3
"""Checks the markdown links of the documentation: every link and image in README.md, docs/*.md,
examples/quality/README.md, bench/results/HISTORY.md and third_party/README.md (or the files
given) points at a file that exists, and a #fragment at a heading of the target (GitHub's
anchors). Prints each bad link; exits non-zero when there is one. Standard library only.
Usage: scripts/check_doc_links.py [file.md ...]"""
import glob
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT = ["README.md", "docs/*.md", "examples/quality/README.md", "bench/results/HISTORY.md",
           "third_party/README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set:
    out, seen, fence = set(), {}, False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fence = not fence
        m = None if fence else re.match(r"^(#{1,6})\s+(.*)", line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def main(argv) -> int:
    files = argv or [f for pattern in DEFAULT for f in sorted(glob.glob(os.path.join(ROOT, pattern)))]
    bad = 0
    for f in files:
        text = open(f, encoding="utf-8").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
        text = re.sub(r"`[^`\n]*`", "", text)             # nor does inline code
        for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
            link = m.group(1)
            if re.match(r"^[a-z]+:", link):
                continue  # http(s), mailto: not checked
            path, _, frag = link.partition("#")
            target = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            if not os.path.exists(target):
                print(f"{os.path.relpath(f, ROOT)}: no file {link}")
                bad += 1
            elif frag and (not target.endswith(".md") or frag not in anchors(target)):
                print(f"{os.path.relpath(f, ROOT)}: no heading for {link}")
                bad += 1
    print(f"{bad} bad link(s) in {len(files)} files" if bad else f"every link resolves ({len(files)} files)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
