"""The documentation holds together: every relative link in README.md and
docs/*.md names a file or directory of the repository (and, with #anchor, a
heading of that page as GitHub renders it), every docs page is listed in both
indexes, the README keeps the two set-up commands and stays short.

Runs under Bazel (tests/ops/BUILD) or by hand from the repository root:
    PYTHONPATH=tests/python /usr/bin/python3 tests/ops/docs_links_test.py
"""
import glob
import os
import re
import unittest

import testlib

# Written elsewhere and linked before they land: checked when present.
PENDING = {"docs/python-install.md", "docs/torch.md"}
README_MAX_LINES = 250
SETUP_HEADING = "## Set-up (two commands, each works on a fresh Debian 12 machine)"
SETUP_COMMANDS = ["    bash examples/run.sh", "    bash tests/run.sh"]


def repo_root():
    """The source tree. Under Bazel README.md and docs/*.md are runfiles
    (symlinks into the tree); links may name any file of the tree, so they are
    resolved where the README really is."""
    for cand in (os.path.join(os.getcwd(), "README.md"),
                 os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")):
        if os.path.isfile(cand):
            return os.path.dirname(os.path.realpath(cand))
    raise AssertionError("README.md not found (run from the repository root)")


ROOT = repo_root()

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def prose_lines(text):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading):
    """GitHub's anchor for a heading: links reduced to their text, lower case,
    everything but letters, digits, '_', '-' and spaces dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path):
    seen = {}
    out = set()
    with open(path, encoding="utf-8") as f:
        for _, line in prose_lines(f.read()):
            m = HEADING.match(line)
            if not m:
                continue
            s = slug(m.group(2))
            k = seen.get(s, 0)
            seen[s] = k + 1
            out.add(s if k == 0 else f"{s}-{k}")
    return out


def pages():
    """README.md and docs/*.md, relative to the root."""
    found = ["README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return found


def links(rel):
    """(line, target) of every link in `rel` outside code."""
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        text = f.read()
    for n, line in prose_lines(text):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            yield n, m.group(1)


class DocsLinksTest(unittest.TestCase):

    def test_relative_links_resolve(self):
        problems = []
        checked = 0
        for page in pages():
            for n, target in links(page):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                if path:
                    dest = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path))
                else:
                    dest = os.path.join(ROOT, page)
                rel = os.path.relpath(dest, ROOT)
                where = f"{page}:{n}: {target}"
                if rel.startswith(".."):
                    problems.append(f"{where}: leaves the repository")
                    continue
                if not os.path.exists(dest):
                    if rel in PENDING:
                        continue
                    problems.append(f"{where}: {rel} does not exist")
                    continue
                checked += 1
                if anchor:
                    if not dest.endswith(".md") or not os.path.isfile(dest):
                        problems.append(f"{where}: an anchor into a file that is not markdown")
                    elif anchor not in anchors(dest):
                        problems.append(f"{where}: {rel} has no heading with anchor #{anchor}")
        self.assertFalse(problems, "broken links:\n" + "\n".join(problems))
        self.assertGreater(checked, 100, "hardly any links found: is the parser broken?")

    def test_pending_pages_are_linked_and_checked_once_present(self):
        # The pages written elsewhere are linked from both indexes (and the
        # Python client page) now; once they exist the test above checks
        # their own links too, since they are docs/*.md.
        for index in ("README.md", "docs/README.md", "docs/python-client.md"):
            targets = {os.path.normpath(os.path.join(os.path.dirname(index), t.partition("#")[0]))
                       for _, t in links(index)}
            for p in PENDING:
                self.assertIn(p, targets, f"{index} does not link {p}")

    def test_every_docs_page_is_in_both_indexes(self):
        docs = {p for p in pages() if p.startswith("docs/") and p != "docs/README.md"} | PENDING
        for index in ("README.md", "docs/README.md"):
            targets = {os.path.normpath(os.path.join(os.path.dirname(index), t.partition("#")[0]))
                       for _, t in links(index)}
            missing = sorted(docs - targets)
            self.assertFalse(missing, f"{index} does not link {missing}")

    def test_readme_is_short_and_keeps_the_setup_commands(self):
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            text = f.read()
        lines = text.count("\n")
        self.assertLessEqual(lines, README_MAX_LINES,
                             f"README.md has {lines} lines; move reference material into docs/")
        self.assertIn(SETUP_HEADING, text)
        setup = text.split(SETUP_HEADING, 1)[1].split("\n## ", 1)[0]
        for cmd in SETUP_COMMANDS:
            self.assertIn(cmd + "\n", setup, f"the set-up section lost `{cmd.strip()}`")

    def test_slugs_follow_github(self):
        self.assertEqual(slug("Set-up (two commands, each works on a fresh Debian 12 machine)"),
                         "set-up-two-commands-each-works-on-a-fresh-debian-12-machine")
        self.assertEqual(slug("GPU nodes: `--config=cuda` (device destinations, pinned cache, NCCL)"),
                         "gpu-nodes---configcuda-device-destinations-pinned-cache-nccl")
        self.assertEqual(slug("Metadata file `{uid}.metadata`"), "metadata-file-uidmetadata")
        self.assertEqual(slug("The safe pickle reader (`core/pickle.h`)"),
                         "the-safe-pickle-reader-corepickleh")


if __name__ == "__main__":
    testlib.main("docs_links_test")
