#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""The smallest-cost set of GPU tests that together launch every kernel shape the GPU suite
launches (greedy weighted set cover), from the census kernel_cover.sh takes. The shapes that count
are those racecheck can find a hazard in: kernels built from kvferry's sources (CUB's templates
included) that use shared memory. cuBLAS's precompiled kernels and kernels without shared memory
are counted apart.

  kernel_cover.py DIR            DIR/tests.txt ("index test seconds" a line) and DIR/<index>.k
                                 (the kernel shapes that test launched): writes DIR/cover.txt
                                 (the chosen tests) and DIR/cover_costs.txt (SAN_COSTS for them)
  kernel_cover.py DIR --ok F...  which kernel shapes and kernels the tests listed in the files F
                                 (e.g. racecheck.ok.txt) launched, out of all of them
"""
import os
import sys

# Under racecheck a test takes about this many times its plain time (kernel-level tests 0.5-10 s
# against 0.01-0.5 s plain); only the order and batching of sanitize.sh's queue use it.
RACE_FACTOR = 20.0


def load(d):
    tests = {}
    for line in open(os.path.join(d, "tests.txt")):
        idx, name, secs = line.split()
        path = os.path.join(d, idx + ".k")
        keys = set(open(path).read().split("\n")) - {""} if os.path.exists(path) else set()
        tests[name] = (float(secs), keys)
    return tests


def kernel(key):
    return key.rsplit(" block=", 1)[0]


def ours(key):
    """Built from kvferry's sources (its namespace, or a CUB template it instantiates)."""
    name = kernel(key)
    return "kvferry" in name or name.startswith("_ZN3cub")


def has_smem(key):
    return not key.endswith(" smem=0")


def main():
    d = sys.argv[1]
    tests = load(d)
    every = set().union(*(k for _, k in tests.values()))
    universe = {k for k in every if ours(k) and has_smem(k)}
    print("kernel shapes: %d launched; %d from cuBLAS, %d without shared memory, %d count" %
          (len(every), sum(1 for k in every if not ours(k)),
           sum(1 for k in every if ours(k) and not has_smem(k)), len(universe)))
    tests = {t: (s, k & universe) for t, (s, k) in tests.items()}
    if len(sys.argv) > 2 and sys.argv[2] == "--ok":
        ok = set()
        for f in sys.argv[3:]:
            ok |= {t.strip() for t in open(f) if t.strip()}
        got = set().union(*(tests[t][1] for t in ok if t in tests)) if ok else set()
        missing = sorted(universe - got)
        print("kernel shapes launched by the passing tests: %d of %d; kernels: %d of %d" %
              (len(got), len(universe), len({kernel(k) for k in got}), len({kernel(k) for k in universe})))
        for k in missing[:40]:
            print("  not covered:", k[:160])
        return
    left, chosen = set(universe), []
    while left:
        best = max(tests, key=lambda t: len(tests[t][1] & left) / (tests[t][0] + 0.2))
        gain = tests[best][1] & left
        if not gain:
            break
        chosen.append(best)
        left -= gain
    with open(os.path.join(d, "cover.txt"), "w") as f:
        f.write("".join(t + "\n" for t in chosen))
    with open(os.path.join(d, "cover_costs.txt"), "w") as f:
        f.write("".join("%s %.1f\n" % (t, RACE_FACTOR * tests[t][0]) for t in chosen))
    with_k = sum(1 for _, k in tests.values() if k)
    print("census: %d tests (%d launch kernels), %d kernel shapes of %d kernels" %
          (len(tests), with_k, len(universe), len({kernel(k) for k in universe})))
    print("cover: %d tests, %.0f s plain (the whole suite: %.0f s plain)" %
          (len(chosen), sum(tests[t][0] for t in chosen), sum(s for s, _ in tests.values())))


if __name__ == "__main__":
    main()
