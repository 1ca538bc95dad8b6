"""`python -m experiments.paper <table> [--repeats N] [--allow-cpu] [--out DIR] [-- benchmark/sweep args]`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from experiments.paper import MIN_REPEATS, TABLES, PaperError, listing, run, sweep_commands, table_from_sweep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.paper", description=(
        "Regenerate a committed table of experiments/results/: median and spread (min–max) over repeats."))
    ap.add_argument("table", nargs="?", help=f"one of: {', '.join(TABLES)}; after `--`: more arguments for its "
                                             "benchmark, or Hydra overrides for its sweep")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"repeats of the whole table (>= {MIN_REPEATS})")
    ap.add_argument("--out", type=Path, default=None, help="where the table goes (default experiments/results)")
    ap.add_argument("--allow-cpu", action="store_true", help="a GPU table without CUDA: a tiny CPU smoke run instead")
    ap.add_argument("--sweep-dir", type=Path, default=None, help="where sweep tables run (default multirun/paper)")
    ap.add_argument("--gpus", type=int, default=1, help="run a sweep's parts side by side, one per GPU (round-robin)")
    ap.add_argument("--print-commands", action="store_true",
                    help="a sweep table: print its part commands (one per line) instead of running them")
    ap.add_argument("--from-sweep", type=Path, default=None,
                    help="a sweep table: write it from this sweep folder (the parts of --print-commands)")
    ap.add_argument("--list", action="store_true", help="print the tables, their commands and devices")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    rest = tuple(argv[cut + 1 :])
    if args.list or not args.table:
        print(listing())
        return 0
    try:
        if args.print_commands:
            _, cmds = sweep_commands(args.table, repeats=args.repeats, extra=rest, sweep_dir=args.sweep_dir)
            print("\n".join(shlex.join(c) for c in cmds))
            return 0
        if args.from_sweep is not None:
            md = table_from_sweep(args.table, args.from_sweep, repeats=args.repeats, out=args.out, extra=rest)
            print(f"table: {md}")
            return 0
        md = run(args.table, repeats=args.repeats, out=args.out, allow_cpu=args.allow_cpu, extra=rest,
                 sweep_root=args.sweep_dir, gpus=args.gpus)
    except PaperError as e:
        print(f"experiments.paper: error: {e}", file=sys.stderr)
        return 2
    print(f"table: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
