"""ckptd_fuzz_target: one fuzz target, built two ways.

    ckptd_fuzz_target(
        name = "pickle",
        srcs = ["pickle_fuzz.cc"],
        deps = ["//core:checkpoint"],
        corpus = "corpus/pickle",
        dict = "dict/pickle.dict",
    )

makes
  :pickle       a cc_binary of the target's sources. Normal build: linked with
                replay_main.cc, it runs LLVMFuzzerTestOneInput once over every
                file or directory named on its command line. Under
                --config=fuzz (--define=fuzz=1, clang): linked with libFuzzer
                (-fsanitize=fuzzer); tests/fuzz/run.sh drives it.
  :pickle_test  an sh_test that runs :pickle over every file of `corpus` (in
                either build: libFuzzer also runs file arguments once each),
                so `bazel test //...` replays the checked-in corpora.
  :pickle_corpus, :pickle_dict (when `dict` is given)  filegroups.

`corpus` is a directory of this package holding the seed inputs.
"""

def ckptd_fuzz_target(name, srcs, deps = [], corpus = None, dict = None, size = "small", **kwargs):
    if not corpus:
        fail("ckptd_fuzz_target %s: `corpus` (a directory of seed inputs) is required" % name)
    fuzzing = "//tests/fuzz:fuzzing"
    native.filegroup(
        name = name + "_corpus",
        srcs = native.glob([corpus + "/**"], exclude_directories = 1, allow_empty = False),
    )
    if dict:
        native.filegroup(
            name = name + "_dict",
            srcs = [dict],
        )
    native.cc_binary(
        name = name,
        srcs = srcs + select({
            fuzzing: [],
            "//conditions:default": ["//tests/fuzz:replay_main.cc"],
        }),
        linkopts = select({
            fuzzing: ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        deps = deps,
        **kwargs
    )
    native.sh_test(
        name = name + "_test",
        size = size,
        srcs = ["//tests/fuzz:replay_test.sh"],
        args = [
            "$(location :%s)" % name,
            "$(locations :%s_corpus)" % name,
        ],
        data = [
            ":" + name,
            ":" + name + "_corpus",
        ],
    )
