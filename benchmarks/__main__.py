"""``python -m benchmarks COMMAND [BENCH] [--problem NAME] [ARGS...]``: the one benchmark tool.

Design. A command says how a number is made; a bench says what is timed; a problem names a bench's
arguments; a method names a row:

* ``run``: measured, a rank a GPU (NCCL), or one GPU for the CP = 1 benches. Benches: ``matrix`` (op,
  mixer and hybrid block on packed documents or one sequence, every method: ``perdoc_measured.py``),
  ``ops`` (op and mixer level with exchange bytes and peak memory: ``bench_ops.py``), ``memory`` (peak
  memory per rank, ranks may share GPUs), ``conv``, ``convert`` (the layout conversion alone), ``mixer-cp1``.
* ``predict``: W >= 2 from one GPU: each rank's work timed alone with its exchange stubbed, replayed over the
  fitted link (``megatron_kcp.calibration.CALIBRATION.link``, the cost model's). Benches: ``matrix``
  (``perdoc.py``), ``strategies`` (every strategy and core at the op: ``simulate.py``), ``host-time`` (a
  rank's host time against its kernels, and its step captured), ``kernel-costs`` (the cost model's steps).
* ``profile``: torch.profiler's kernel tables: ``ops`` (noCP beside each kcp method, every rank), ``mixer-cp1``.
* ``compare CSV [--base COMMIT]``: a results file beside itself at a base commit (``compare.py``).
* ``gpu-checks [SUITE ...]``: the GPU test suites (``gpu_checks.py``; ``scripts/device.sh`` wraps it on the
  device machine, with the compile caches).

The problems (``catalogue.py``: shapes, document sets, named problems such as the tables' ones), the
methods (``methods.py``: peers and our picks, ablations as declared options, environment or a strategy
subclass swapped in) and the results schema (``schema.py``: the tables' columns plus source, commit, GPU,
versions and date; its reader reads every file under ``benchmarks/results/``) are one each. ``--smoke`` runs
a bench on the CPU at tiny sizes (a check of the code, not a measurement). ``python -m benchmarks COMMAND
BENCH --help`` lists a bench's arguments; ``python -m benchmarks problems`` the named problems.
"""
from __future__ import annotations

import importlib
import sys

from benchmarks.catalogue import PROBLEMS

# command: {bench: (module, arguments it is given first)}
BENCHES = {
    "run": {"matrix": ("perdoc_measured", ()), "ops": ("bench_ops", ()), "memory": ("bench_ops", ("--memory-only",)),
            "conv": ("conv", ()), "convert": ("convert", ()), "mixer-cp1": ("mixer_cp1", ())},
    "predict": {"matrix": ("perdoc", ()), "strategies": ("simulate", ()), "host-time": ("host_time", ()),
                "kernel-costs": ("kernel_costs", ())},
    "profile": {"ops": ("bench_ops", ("--what", "profile")), "mixer-cp1": ("mixer_cp1", ("--profile",))},
}
DEFAULT = {"run": "matrix", "predict": "matrix", "profile": "ops"}
COMMANDS = (*BENCHES, "compare", "gpu-checks", "problems")


def resolve(argv: list[str]) -> tuple[str, str, list[str]]:
    """(module, prog, its argument list) of ``run`` / ``predict`` / ``profile`` arguments: the bench named
    first (else the problem's, else the command's default), the problem's arguments before the rest."""
    command, rest = argv[0], list(argv[1:])
    problem = None
    if "--problem" in rest:
        i = rest.index("--problem")
        if i + 1 >= len(rest) or rest[i + 1] not in PROBLEMS:
            raise SystemExit(f"--problem: name one of {', '.join(PROBLEMS)}")
        name, problem = rest[i + 1], PROBLEMS[rest[i + 1]]
        del rest[i:i + 2]
        if problem.command != command:
            raise SystemExit(f"problem {name} is a {problem.command!r} problem: "
                             f"python -m benchmarks {problem.command} --problem {name}")
    if rest and rest[0] in BENCHES[command]:
        bench = rest.pop(0)
    elif rest and not rest[0].startswith("-"):
        raise SystemExit(f"{command}: unknown bench {rest[0]!r}: choose one of {', '.join(BENCHES[command])}")
    else:
        bench = problem.bench if problem else DEFAULT[command]
    if problem and problem.bench != bench:
        raise SystemExit(f"the problem runs bench {problem.bench!r}, not {bench!r}")
    module, first = BENCHES[command][bench]
    return module, f"python -m benchmarks {command} {bench}", [*first, *(problem.args if problem else ()), *rest]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command = argv[0]
    if command == "problems":
        for name, p in PROBLEMS.items():
            print(f"{name:14} {p.command} {p.bench:10} {p.about}")
        return 0
    if command == "compare":
        from benchmarks import compare
        return compare.main(argv[1:], "python -m benchmarks compare")
    if command == "gpu-checks":
        import argparse

        from benchmarks import gpu_checks
        p = argparse.ArgumentParser(prog="python -m benchmarks gpu-checks", description=gpu_checks.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("suites", nargs="*", metavar="SUITE", help="default: every suite")
        p.add_argument("--list", action="store_true", help="print the suites and their pytest arguments")
        p.add_argument("--jobs", type=int, default=None, help="suites at a time (default: three a GPU)")
        p.add_argument("--timeout", type=float, default=900.0, help="seconds a suite may run")
        p.add_argument("--skip-memory", action="store_true", help="leave the memory report out")
        a = p.parse_args(argv[1:])
        if a.list:
            for s in gpu_checks.SUITES:
                print(s.name, " ".join(f"{k}={v}" for k, v in s.env.items()), " ".join(s.command()[1:]))
            return 0
        return gpu_checks.main(a.suites, a.jobs, a.timeout, skip_memory=a.skip_memory)
    module, prog, args = resolve(argv)
    rc = importlib.import_module(f"benchmarks.{module}").main(args, prog)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
