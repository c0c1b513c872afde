#!/usr/bin/env python3
"""Checks that the project's own documentation holds together.

    tests/docs/check_docs.py REPO_ROOT

Over the repository's source files (tracked and untracked but not ignored, as
`git ls-files --cached --others --exclude-standard` lists them; with extensions .h, .cc,
.cu, .cuh, .proto, .py, .txt, .cmake and .md):

  (a) every citation `docs/<name>.md#<anchor>` names a file that exists and a heading of it
      whose GitHub anchor is <anchor>; every plain `docs/<name>.md` names a file that exists;
      and every relative Markdown link of a .md file (`[text](path)`, `[text](x.md#anchor)`,
      `[text](#anchor)`) leads to a file that exists and, where it names one, a heading;
  (b) no file mentions the team's background design notes, which live outside the
      repository: the repository describes itself in docs/architecture.md;
  (c) every docs/*.dot has its rendered docs/*.svg (scripts/render-docs writes them).

Prints each failure as `path:line: message` and exits 1 when there is any, else prints one
summary line and exits 0. Standard library only.
"""

import os
import re
import subprocess
import sys

SOURCE_EXTENSIONS = (".h", ".cc", ".cu", ".cuh", ".proto", ".py", ".txt", ".cmake", ".md")

# The name is assembled so that this file does not mention it itself.
OUTSIDE_DESIGN_NOTES = "DESIGN" + ".md"

# docs/<name>.md, optionally followed by #<anchor>; not part of a longer path
# (client/python/docs/x.md is another folder's).
CITATION = re.compile(r"(?<![\w./-])docs/([A-Za-z0-9_.-]+?\.md)(?:#([A-Za-z0-9_-]+))?")

ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
# The target of a Markdown inline link or image: [text](target) or [text](target "title").
LINK_TARGET = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_TAG = re.compile(r"<[^>]+>")


def list_files(root):
    """Repository-relative paths of the source files to check."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root, check=True, capture_output=True).stdout.decode("utf-8", "replace")
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (a source tarball): walk the tree, leaving build trees out.
        paths = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith((".git", "build"))]
            for f in filenames:
                paths.append(os.path.relpath(os.path.join(dirpath, f), root))
    paths = sorted(set(p.replace(os.sep, "/") for p in paths))
    return [p for p in paths
            if p.endswith(SOURCE_EXTENSIONS) and os.path.isfile(os.path.join(root, p))]


def read_lines(path):
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        return f.read().splitlines()


def markdown_lines(path):
    """(number, line) for every line of a Markdown file, numbered from 1; line is None for
    the lines of fenced code blocks and their fences."""
    fence = None
    for number, line in enumerate(read_lines(path), start=1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            yield number, None
        elif m:
            fence = m.group(1)
            yield number, None
        else:
            yield number, line


def github_anchor(text):
    """The anchor GitHub gives a heading: its text lowercased, punctuation other than '-'
    and '_' dropped, spaces turned into '-'."""
    text = INLINE_LINK.sub(r"\1", text)
    text = HTML_TAG.sub("", text)
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def heading_anchors(path):
    """Every anchor the headings of a Markdown file produce, duplicates numbered as GitHub
    numbers them (x, x-1, x-2, ...)."""
    anchors = set()
    seen = {}
    previous = None  # the previous line, when it could be a setext heading's text

    def add(text):
        base = github_anchor(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else "%s-%d" % (base, n))

    for _, line in markdown_lines(path):
        if line is None:
            previous = None
            continue
        m = ATX_HEADING.match(line)
        if m:
            add(m.group(2) or "")
            previous = None
            continue
        if previous is not None and SETEXT_UNDERLINE.match(line):
            add(previous)
            previous = None
            continue
        stripped = line.strip()
        previous = stripped if stripped and not line.startswith("    ") else None
    return anchors


def check_links(root, rel, anchors_of, failures):
    """Checks the relative links of Markdown file `rel` (outside fenced code); returns how
    many it checked."""
    checked = 0
    base = os.path.dirname(rel)
    for number, line in markdown_lines(os.path.join(root, rel)):
        if line is None:
            continue
        for link in LINK_TARGET.finditer(line):
            target = link.group(1)
            if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("//"):
                continue  # a URL (https:, mailto:): not ours to check
            checked += 1
            path, _, anchor = target.partition("#")
            if path:
                resolved = os.path.normpath(os.path.join(base, path)).replace(os.sep, "/")
                if resolved.startswith("../") or resolved == "..":
                    failures.append("%s:%d: link %s leaves the repository" % (rel, number,
                                                                              target))
                    continue
                if not os.path.exists(os.path.join(root, resolved)):
                    failures.append("%s:%d: link %s: %s does not exist" % (rel, number,
                                                                          target, resolved))
                    continue
            else:
                resolved = rel
            if anchor and resolved.endswith(".md"):
                anchors = anchors_of(resolved)
                if anchors is not None and anchor not in anchors:
                    failures.append("%s:%d: link %s: %s has no heading with anchor #%s"
                                    % (rel, number, target, resolved, anchor))
    return checked


def main(argv):
    if len(argv) != 2:
        print("usage: %s REPO_ROOT" % os.path.basename(argv[0]), file=sys.stderr)
        return 2
    root = os.path.abspath(argv[1])
    if not os.path.isdir(os.path.join(root, "docs")):
        print("%s: no docs/ folder: is this the repository root?" % argv[1], file=sys.stderr)
        return 2

    failures = []
    anchor_cache = {}
    citations = 0
    cited_docs = set()

    links = 0

    def anchors_of(rel):
        """The heading anchors of the Markdown file `rel`, or None when it does not exist."""
        if rel not in anchor_cache:
            full = os.path.join(root, rel)
            anchor_cache[rel] = heading_anchors(full) if os.path.isfile(full) else None
        return anchor_cache[rel]

    files = list_files(root)
    for rel in files:
        for number, line in enumerate(read_lines(os.path.join(root, rel)), start=1):
            if OUTSIDE_DESIGN_NOTES in line:
                failures.append("%s:%d: mentions %s, which is not in the repository; cite "
                                "docs/architecture.md instead" % (rel, number,
                                                                  OUTSIDE_DESIGN_NOTES))
            for m in CITATION.finditer(line):
                doc, anchor = m.group(1), m.group(2)
                citations += 1
                cited_docs.add(doc)
                anchors = anchors_of("docs/" + doc)
                if anchors is None:
                    failures.append("%s:%d: docs/%s does not exist" % (rel, number, doc))
                elif anchor is not None and anchor not in anchors:
                    failures.append("%s:%d: docs/%s has no heading with anchor #%s"
                                    % (rel, number, doc, anchor))
        if rel.endswith(".md"):
            links += check_links(root, rel, anchors_of, failures)
    docs_dir = os.path.join(root, "docs")
    diagrams = sorted(f for f in os.listdir(docs_dir) if f.endswith(".dot"))
    for dot in diagrams:
        svg = dot[:-len(".dot")] + ".svg"
        svg_path = os.path.join(docs_dir, svg)
        if not os.path.isfile(svg_path) or os.path.getsize(svg_path) == 0:
            failures.append("docs/%s:1: docs/%s is missing: run scripts/render-docs"
                            % (dot, svg))

    for f in failures:
        print(f)
    if failures:
        print("check_docs: %d failure(s)" % len(failures), file=sys.stderr)
        return 1
    print("check_docs: OK: %d files, %d citations of %d docs, %d Markdown links, "
          "%d diagram(s) rendered, no mention of %s"
          % (len(files), citations, len(cited_docs), links, len(diagrams),
             OUTSIDE_DESIGN_NOTES))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
