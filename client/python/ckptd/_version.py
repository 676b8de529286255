"""The client's version and API level, read from VERSION at the top of the
ckptd source tree (the one place they are set; the daemon and ckptctl read it
too).

An installed package does not have this file: client/python/setup.py writes
a _version.py with the two values in its place when it builds the package.
From a source tree or Bazel runfiles (client/python/ckptd/ three levels below
VERSION) this module reads the file itself. Without it, __version__ is
"0+unknown" and API_LEVEL 1 (the lowest: no daemon is refused).
"""
import os
import re


def read_version_file(path):
    """(version, api_level) from a VERSION file ("version: 0.1", "api_level: 1")."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    v = re.search(r"^version: *([0-9][0-9.]*) *$", text, re.M)
    a = re.search(r"^api_level: *([1-9][0-9]*) *$", text, re.M)
    if v is None or a is None:
        raise ValueError(f'{path}: needs the lines "version: N.N" and "api_level: N"')
    return v.group(1), int(a.group(1))


def _from_tree():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "VERSION")
    try:
        return read_version_file(path)
    except OSError:
        return "0+unknown", 1


__version__, API_LEVEL = _from_tree()
