"""Layering and size rules for the C++ sources (issue 32 ratchets).

1. Includes respect the layers: core/ includes nothing of server/, client/,
   proto/, config/, gRPC or CUDA/NCCL; client/ nothing of server/; config/
   nothing of server/ or client/; proto/peer*.pb.h only from PEER_PROTO_DIRS
   (tests/ may include anything).
2. No .h/.cc/.cu file in server/ or core/ over 800 lines but OVERSIZE_FILES;
3. no function there over 120 lines but LONG_FUNCTIONS. Both are ratchets: an
   entry past its cap fails, and so does one back under the limit (remove it).
4. File-system calls in core/ and server/ only in the storage implementation
   (core/io/file_posix.cc) and in OWN_FILES: every checkpoint file is reached
   through core/io's Storage interface (issue 32), so a new storage (s3://)
   and injected faults cover all of them.

Finding the source tree: Bazel globs cannot cross packages and there are no
source filegroups, so the test reads the tree in place. Its runfile README.md
(//:README.md in data) is a symlink straight to the source file (the
runfiles manifest maps ckptd/README.md to <checkout>/README.md), and the sandbox
leaves the tree readable, so dirname(os.path.realpath(README.md)) is the root,
as in docs_links_test.py. The sources are not declared inputs, hence the
"external" tag (never cached) in tests/ops/BUILD.

    /usr/bin/python3 tests/ops/layering_test.py            # from anywhere
    /usr/bin/python3 tests/ops/layering_test.py --report   # today's offenders
"""
import bisect
import os
import re
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
try:
    import testlib  # JUnit XML per case under Bazel; needs numpy
except ImportError:
    testlib = None

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 120
SCANNED_DIRS = ("core", "server", "client", "config", "bench")  # tests/: anything goes
SIZED_DIRS = ("core", "server")
EXTENSIONS = (".h", ".cc", ".cu")

# The peer protocol is the peer plane's and the multi-node code's: only
# files in these folders include it (issue 32).
PEER_PROTO_DIRS = ("server/peer/", "server/multinode/")
PEER_PROTO = {"proto/peer.pb.h", "proto/peer.grpc.pb.h"}

# Layer violations that exist and are accepted for now: {(file, included): reason}.
KNOWN_VIOLATIONS = {}

SPLIT = "issue 32: to be split into components"
# Caps are today's line counts: --report prints the current figures.
OVERSIZE_FILES = {  # {path: (line cap, reason)}; none left
}

# Overloads of one name in one file share an entry (each must fit the cap).
LONG_FUNCTIONS = {  # {(path, function as written): (line cap, reason)}
    ("core/format/pickle.cc", "Machine::Run"): (272, "table-like: the pickle opcode interpreter, one "
                                              "switch case per opcode; allowed as it is"),
}


def repo_root():
    """The real source tree: where README.md (beside this file's tests/, or in
    the working directory) resolves to through its symlinks."""
    for cand in (os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md"),
                 os.path.join(os.getcwd(), "README.md")):
        if os.path.isfile(cand):
            return os.path.dirname(os.path.realpath(cand))
    raise AssertionError("README.md not found (run from the repository root)")


ROOT = repo_root()


def sources(dirs):
    """Relative paths of the C++ sources under `dirs`, sorted."""
    found = []
    for top in dirs:
        for d, subdirs, files in os.walk(os.path.join(ROOT, top)):
            subdirs[:] = [s for s in subdirs if s != "third_party" and not s.startswith("bazel-")]
            found += [os.path.relpath(os.path.join(d, f), ROOT) for f in files if f.endswith(EXTENSIONS)]
    return sorted(found)


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


# ---- The C++ scanner --------------------------------------------------------

LITERAL = re.compile(r"//[^\n]*|/\*.*?\*/"                    # comments
                     r'|(?<!\w)(?:u8|[uUL])?R"([^()\\\s"]{0,16})\(.*?\)\1"'  # R"x(..)x"
                     r"""|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'"""  # "..", '.'
                     r"|\b\d[\w.']*", re.S)                      # numbers, 100'000: kept
PREPROCESSOR = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)


def blank(s):  # spaces for all but the newlines
    return re.sub(r"[^\n]", " ", s)


def strip_code(text):
    """`text` with comments, the contents of string and char literals (raw
    strings too) and preprocessor lines blanked; same length and lines."""
    def literal(m):
        s = m.group()
        if s[0].isdigit():
            return s
        if s[0] == "/":
            return blank(s)
        k = s.index(s[-1])  # the opening quote
        return s[:k + 1] + blank(s[k + 1:-1]) + s[-1]
    return PREPROCESSOR.sub(lambda m: blank(m.group()), LITERAL.sub(literal, text))


def match_open(s, close):
    """Index of the '(' matching the ')' at s[close], or -1."""
    depth = 0
    for k in range(close, -1, -1):
        depth += {")": 1, "(": -1}.get(s[k], 0)
        if depth == 0:
            return k
    return -1


def depth0(s, token):
    """Indices of `token` outside (), [] and {} in s ("::" is never a ':')."""
    depth, found = 0, []
    for k, c in enumerate(s):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(c, 0)
        if depth == 0 and s.startswith(token, k):
            if token != ":" or (s[k - 1:k] != ":" and s[k + 1:k + 2] != ":"):
                found.append(k)
    return found


QUALIFIER = re.compile(r"(?:\b(?:const|override|final|noexcept|volatile|mutable|try)|&&?)$")
ANNOTATION = re.compile(r"\b(?:noexcept|throw|__attribute__|[A-Z][A-Z0-9_]*[A-Z0-9])\s*$")


def peel(h, end):
    """End of h[:end] less trailing qualifiers (const, noexcept(..), ABSL_X(..))."""
    while True:
        t = h[:end].rstrip()
        end = len(t)
        m = QUALIFIER.search(t)
        if m:
            end = m.start()
            continue
        if t.endswith(")"):
            o = match_open(t, end - 1)
            m = ANNOTATION.search(t[:max(o, 0)])
            if o > 0 and m and h[:peel(h, m.start())].endswith(")"):
                end = m.start()
                continue
        return end


NAME = re.compile(r"((?:~?\w+\s*(?:<[^<>;{}]*>)?\s*::\s*)*"
                  r"(?:operator\s*(?:\(\s*\)|\[\s*\]|[^\w\s(]+|\w[\w\s:<>*&]*?)|~?[A-Za-z_]\w*))\s*$")
CONTROL = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof"}


def classify(head):
    """What a '{' opens at file, namespace or class scope, given the text of
    the declaration before it: (kind, name, offset of the name in head)."""
    h = re.sub(r"^\s*(?:(?:public|private|protected)\s*:\s*)+", lambda m: " " * len(m.group()), head)
    s = h.strip()
    if re.match(r"(?:inline\s+)?namespace\b", s) or re.fullmatch(r'extern\s*"\s*"', s):
        return "scope", None, 0
    if re.match(r"(?:template\s*<.*>\s*)?enum\b", s, re.S):
        return "block", None, 0
    if re.match(r"(?:template\s*<.*>\s*)?(?:class|struct|union)\b", s, re.S) and not s.endswith(")"):
        return "scope", None, 0
    end = len(h)
    for colon in depth0(h, ":")[:1]:  # constructor: Name(args) : a_(x), b_{y}
        if h[:peel(h, colon)].endswith(")"):
            if h[colon + 1:].rstrip()[-1:] not in (")", "}"):
                return "init", None, 0  # a braced member initializer: b_{
            end = colon
    for arrow in depth0(h[:end], "->")[:1]:  # trailing return type
        if h[:peel(h, arrow)].endswith(")"):
            end = arrow
    end = peel(h, end)
    if not h[:end].endswith(")"):
        return "init", None, 0  # Type x{..}, Type x = {..}
    pre = h[:max(match_open(h, end - 1), 0)].rstrip()
    if pre.endswith("]"):  # a lambda at namespace scope: named after its variable
        m = re.search(r"(\w+)\s*=\s*\[[^\]]*\]$", pre)
        return ("function", m.group(1), m.start(1)) if m else ("function", "<lambda>", len(pre))
    m = NAME.search(pre)
    if not m or m.group(1).split("::")[-1].strip() in CONTROL:
        return "block", None, 0
    return "function", re.sub(r"\s+", "", m.group(1)), m.start(1)


def functions(text):
    """[(name, first line, last line)] of the functions defined at file,
    namespace or class scope (lambdas and local classes count toward the
    function around them). Raises ValueError on unbalanced braces."""
    code = strip_code(text)
    starts = [0] + [k + 1 for k, c in enumerate(code) if c == "\n"]
    line = lambda pos: bisect.bisect_right(starts, pos)
    stack = [("scope", 0, None, 0)]  # (kind, declaration start, name, name position)
    start, found = 0, []
    for i, c in enumerate(code):
        if c == ";" and stack[-1][0] == "scope":
            start = i + 1
        elif c == "{":
            kind, name, off = classify(code[start:i]) if stack[-1][0] == "scope" else ("block", None, 0)
            stack.append((kind, start, name, start + off))
            if kind == "scope":
                start = i + 1
        elif c == "}":
            if len(stack) == 1:
                raise ValueError(f"unbalanced '}}' at line {line(i)}")
            kind, decl_start, name, pos = stack.pop()
            if kind == "function":
                found.append((name, line(pos), line(i)))
            if stack[-1][0] == "scope":  # a braced initializer continues its declaration
                start = decl_start if kind == "init" else i + 1
    if len(stack) != 1:
        raise ValueError(f"{len(stack) - 1} unclosed '{{' at the end")
    return found


# ---- The rules ---------------------------------------------------------------

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
GRPC = re.compile(r"^grpc(?:pp|\+\+)?[/.]")
CUDA = re.compile(r"^(?:cuda\w*\.h|cuda_runtime\w*(?:\.h)?|nccl\.h)$")
FORBIDDEN = {  # layer: [(what may not be included, test on the included path)]
    "core/": [("server/", r"^server/"), ("client/", r"^client/"), ("proto/", r"^proto/"),
              ("config/", r"^config/"), ("gRPC", GRPC), ("CUDA/NCCL", CUDA)],
    "client/": [("server/", r"^server/")],
    "config/": [("server/", r"^server/"), ("client/", r"^client/")],
}


def include_violations():
    """{(file, included): (line, rule)} for every include breaking a layer."""
    out = {}
    for rel in sources(SCANNED_DIRS):
        text = read(rel)
        for m in INCLUDE.finditer(text):
            target, n = m.group(2).strip(), text.count("\n", 0, m.start()) + 1
            for layer, rules in FORBIDDEN.items():
                for what, pattern in rules if rel.startswith(layer) else ():
                    if re.search(pattern, target):
                        out[(rel, target)] = (n, f"{layer} may not include {what}")
            if target in PEER_PROTO and not rel.startswith(PEER_PROTO_DIRS):
                out.setdefault((rel, target), (n, "the peer protocol outside PEER_PROTO_DIRS"))
    return out


def module_of(rel, modules):
    """The module a source file belongs to: its path without extension, or a
    sibling module its name extends with '_' (aoa_parse.cc and aoa_internal.h
    are aoa's; saves_dcp.cc is saves')."""
    base = os.path.splitext(rel)[0]
    d, name = os.path.split(base)
    parts = name.split("_")
    for k in range(1, len(parts)):
        cand = os.path.join(d, "_".join(parts[:k]))
        if cand in modules:
            return cand
    return base


def module_cycles(top):
    """Cycles among the modules of `top` (core/ or server/): module A depends
    on B when a file of A includes a header of B. A cycle (checkpoint.cc
    including foreign.h, which includes checkpoint.h) means neither can be
    built, read or tested without the other."""
    files = sources([top])
    modules = {os.path.splitext(f)[0] for f in files}
    graph = {}
    for rel in files:
        a = module_of(rel, modules)
        for m in INCLUDE.finditer(read(rel)):
            if m.group(1) == '"' and m.group(2) in files:
                b = module_of(m.group(2), modules)
                if b != a:
                    graph.setdefault(a, set()).add(b)
    cycles, state = [], {}

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def line_count(rel):
    return len(read(rel).splitlines())


def long_functions():
    """{(path, name): [(lines, first line)]} of the functions over the limit."""
    out = {}
    for rel in sources(SIZED_DIRS):
        try:
            fns = functions(read(rel))
        except ValueError as e:
            raise AssertionError(f"{rel}: the scanner cannot parse it: {e}") from None
        for name, first, last in fns:
            if last - first + 1 > MAX_FUNCTION_LINES:
                out.setdefault((rel, name), []).append((last - first + 1, first))
    return out


def ratchet(found, listed, limit, table):
    """Problems of a ratchet: `found` {key: (size, where)} over the limit,
    `listed` {key: (cap, reason)}."""
    problems = []
    for key, (size, where) in sorted(found.items()):
        if key not in listed:
            problems.append(f"{where}: {size} lines, over the limit of {limit}; split it "
                            f"(or list it in {table})")
        elif size > listed[key][0]:
            problems.append(f"{where}: {size} lines, past its cap of {listed[key][0]} "
                            f"in {table} ({listed[key][1]})")
    for key in sorted(set(listed) - set(found)):
        key = key if isinstance(key, str) else ": ".join(key)
        problems.append(f"{key}: now at most {limit} lines (or gone); remove it from {table}")
    return problems

# Rule 4: the calls that touch a file system by path or descriptor.
FS_CALL = re.compile(r"(?<![\w.>])(?:::)?(open|openat|openat2|stat|lstat|fstatat|realpath|opendir|"
                     r"fdopendir|readdir|mkdir|mkdirat|unlink|unlinkat|rename|renameat|pread|"
                     r"preadv2|pwrite|flock|faccessat|access|fopen)\s*\(")
FS_CALL_ALLOWED = {"core/io/file_posix.cc"}
# Files that touch the file system for the daemon's own things, never a
# checkpoint's: {path: reason}.
OWN_FILES = {
    "core/cache/cache.cc": "a read-only view of the cache's own memfd (/proc/self/fd); the "
                           "kernel's shmem THP setting (/sys)",
    "server/lifecycle.cc": "the daemon's socket and port files",
    "server/delivery/fd_channel.cc": "the fd-passing socket",
    "server/api/uds_listener.cc": "the gRPC Unix socket",
    "server/obs/metrics.cc": "/proc/self for process metrics",
    "server/pem.h": "TLS files",
    "server/policy/policy.cc": "the socket's group (default access rule)",
    "core/io/s3/s3_storage.cc": "the local spool file (O_TMPFILE) an upload is staged in",
}


def fs_call_violations():
    """{file: [line numbers]} of file-system calls outside the storage."""
    found = {}
    for rel in sources(SIZED_DIRS):
        if rel in FS_CALL_ALLOWED or rel in OWN_FILES or "/cuda/" in rel:
            continue
        text = strip_code(read(rel))
        lines = [text.count("\n", 0, m.start()) + 1 for m in FS_CALL.finditer(text)]
        if lines:
            found[rel] = lines
    return found


class LayeringTest(unittest.TestCase):
    longMessage = False  # the messages below say it all

    def test_scanner_on_a_snippet(self):
        snippet = "\n".join([
            'namespace ns {',                                                # 1
            'int Three(int a) {',                                            # 2
            '  return a;',
            '}',                                                             # 4
            'class Widget : public Base {',
            ' public:',
            '  Widget(int a, int b) : a_(a), b_{b} {',                       # 7
            '    auto f = [&](int x) {',
            '      return x + a_;  // }',
            '    };',
            '    f(1);',
            '  }',                                                           # 12
            '  int Get() const ABSL_LOCKS_EXCLUDED(mu_) { return a_; }',     # 13
            '  bool operator==(const Widget& o) const { return a_ == o.a_; }',  # 14
            ' private:',
            '  int a_, b_;  };',
            'const char* kText = "}{";  /* { */ const char kOpen = \'{\';',
            'const char* kRaw = R"x(})x"; const int64_t kBig = 1\'000\'000;',
            'const auto kTwice = [](int x) -> int { return 2 * x; };',       # 19
            'std::map<int, int> kTable = {{1, 2}, {3, 4}};',
            'enum class Color : int { kRed, kBlue };',
            '#define BRACE {',
            'extern "C" {',
            'void CFunc() noexcept { if (true) { for (;;) {} } }',            # 24
            '}',
            'template <typename T> auto Foo<T>::Bar(T t) -> decltype(t) {',  # 26
            '  switch (t) { case 1: { break; } }',
            '}',                                                             # 28
            '}  // namespace ns',
        ])
        self.assertEqual(functions(snippet), [
            ("Three", 2, 4), ("Widget", 7, 12), ("Get", 13, 13), ("operator==", 14, 14),
            ("kTwice", 19, 19), ("CFunc", 24, 24), ("Foo<T>::Bar", 26, 28)])
        with self.assertRaises(ValueError):
            functions("void F() {\n")

    def test_includes_respect_the_layers(self):
        found = include_violations()
        order = sorted(found.items(), key=lambda kv: (kv[0][0], kv[1][0]))  # file, line
        problems = [f"{rel}:{n}: includes {target}: {rule}"
                    for (rel, target), (n, rule) in order if (rel, target) not in KNOWN_VIOLATIONS]
        problems += [f"{key}: no longer there; remove it from KNOWN_VIOLATIONS"
                     for key in sorted(set(KNOWN_VIOLATIONS) - set(found))]
        self.assertFalse(problems, "layer violations:\n" + "\n".join(problems))

    def test_file_system_only_through_the_storage(self):
        found = fs_call_violations()
        problems = [f"{rel}:{n}: calls the file system directly; go through core/io's Storage "
                    "(or list the file in OWN_FILES with why)" for rel, ns in sorted(found.items())
                    for n in ns]
        problems += [f"{rel}: no longer calls the file system; remove it from OWN_FILES"
                     for rel in sorted(OWN_FILES) if not FS_CALL.search(strip_code(read(rel)))]
        self.assertFalse(problems, "file-system calls outside the storage:\n" + "\n".join(problems))

    def test_no_include_cycles(self):
        cycles = module_cycles("core") + module_cycles("server")
        self.assertFalse(cycles, "modules that include each other:\n" +
                         "\n".join(" -> ".join(c) for c in cycles))

    def test_file_sizes(self):
        found = {}
        for rel in sources(SIZED_DIRS):
            n = line_count(rel)
            if n > MAX_FILE_LINES:
                found[rel] = (n, f"{rel}:{MAX_FILE_LINES + 1}: the file")
        problems = ratchet(found, OVERSIZE_FILES, MAX_FILE_LINES, "OVERSIZE_FILES")
        self.assertFalse(problems, "files too long:\n" + "\n".join(problems))

    def test_function_lengths(self):
        self.assertIn("main", [f[0] for f in functions(read("server/main.cc"))],
                      "server/main.cc: no main() found: is the scanner broken?")
        found = {}
        for (rel, name), hits in long_functions().items():
            n, first = max(hits)
            found[(rel, name)] = (n, f"{rel}:{first}: {name}")
        problems = ratchet(found, LONG_FUNCTIONS, MAX_FUNCTION_LINES, "LONG_FUNCTIONS")
        self.assertFalse(problems, "functions too long:\n" + "\n".join(problems))


def report():
    """Today's offenders of rules 2 and 3, largest first, as list entries."""
    def reason(table, key):
        r = table.get(key, (0, SPLIT))[1]
        return "SPLIT" if r == SPLIT else repr(r)
    print(f"# files over {MAX_FILE_LINES} lines (OVERSIZE_FILES)")
    for n, rel in sorted(((line_count(r), r) for r in sources(SIZED_DIRS)), reverse=True):
        if n > MAX_FILE_LINES:
            print(f'    "{rel}": ({n}, {reason(OVERSIZE_FILES, rel)}),')
    print(f"# functions over {MAX_FUNCTION_LINES} lines (LONG_FUNCTIONS)")
    for (n, first), key in sorted(((max(h), k) for k, h in long_functions().items()), reverse=True):
        print(f'    ("{key[0]}", "{key[1]}"): ({n}, {reason(LONG_FUNCTIONS, key)}),  # line {first}')


if __name__ == "__main__":
    if "--report" in sys.argv[1:]:
        report()
    elif testlib:
        testlib.main("layering_test")
    else:
        unittest.main()
