"""``python -m tandem_sim {list,explore,replay}``.

Exit status: 0 when every explored schedule passed (or a replay reproduced its recording),
1 when a failure was found, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from tandem_sim.explore import STRATEGIES, ReplayMismatch, explore, replay, save
from tandem_sim.scenarios import SCENARIOS


def main(argv: list[str] | None = None) -> int:
    # Scenarios fail engines on purpose, thousands of times: their error logs would bury
    # the verdict (a failing schedule is reported, and replays, on its own).
    logging.basicConfig(level=logging.CRITICAL)
    parser = argparse.ArgumentParser(prog="python -m tandem_sim")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="name the scenarios")
    ex = sub.add_parser("explore", help="run a scenario under many schedules")
    ex.add_argument("scenario", choices=sorted(SCENARIOS))
    ex.add_argument("--strategy", choices=STRATEGIES, default="pct")
    ex.add_argument("--schedules", type=int, default=200)
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--out", type=Path, default=None, help="where a failing schedule goes")
    rp = sub.add_parser("replay", help="re-run a saved failing schedule")
    rp.add_argument("file", type=Path)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0
    if args.command == "list":
        for name, spec in sorted(SCENARIOS.items()):
            kind = "broken" if spec.broken else "correct"
            print(f"{name:32} {kind:8} {spec.bug}")
        return 0
    if args.command == "explore":
        if args.schedules < 1:
            print("error: --schedules must be >= 1", file=sys.stderr)
            return 2
        result = explore(SCENARIOS[args.scenario], args.strategy, args.schedules, args.seed)
        if result.failure is None:
            print(f"{args.scenario}: {result.runs} schedules passed ({args.strategy}, "
                  f"seed {args.seed})")  # fmt: skip
            return 0
        out = args.out or Path(tempfile.mkdtemp(prefix="tandem-sim-")) / f"{args.scenario}.json"
        save(result, out)
        print(f"{args.scenario}: FAILED after {result.failing_run} schedules ({args.strategy}, "
              f"seed {args.seed}): {result.failure.describe()}")  # fmt: skip
        print(f"replay: python -m tandem_sim replay {out}")
        return 1
    try:
        record, outcome = replay(args.file)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: cannot replay {args.file}: {exc}", file=sys.stderr)
        return 2
    except ReplayMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{record['scenario']}: replayed {len(outcome.decisions)} decisions: "
          f"{outcome.describe() if not outcome.ok else 'passed'}")  # fmt: skip
    return 1 if not outcome.ok else 0


if __name__ == "__main__":
    sys.exit(main())
