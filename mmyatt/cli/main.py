"""`mmyatt train | sft | serve-genrm | bench | inspect | demo`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mmyatt.bench import registry
from mmyatt.config.schema import ConfigError


def _user_error(error: BaseException) -> str | None:
    """One line for an error the user caused (config, data, files), else None."""
    from mmyatt.datasets.manifest import ManifestError
    from mmyatt.datasets.media import MediaError

    if isinstance(error, ConfigError):
        return f"config error: {error}"
    if isinstance(error, (ManifestError, MediaError)):
        return f"data error: {error}"
    if isinstance(error, FileNotFoundError):
        if error.filename is not None:
            return f"file not found: {error.filename} ({error.strerror})"
        return f"file not found: {error}"
    return None


def main(argv: list[str] | None = None) -> int:
    """The CLI. Errors the user caused print one line and exit 2; ``--debug`` (anywhere
    on the command line, or MMYATT_DEBUG=1, which controllers inherit) shows the
    traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ["MMYATT_DEBUG"] = "1"
    debug = os.environ.get("MMYATT_DEBUG") == "1"
    p = argparse.ArgumentParser(
        prog="mmyatt",
        description=__doc__,
        epilog="--debug: show the traceback of errors in config, data or files",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="RL training run: mmyatt train CONFIG [key=value ...]")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.kl_coef=0.01")
    t.add_argument("--run-dir", default=None, help="where the run goes (default runs/<name>)")

    s = sub.add_parser("sft", help="supervised fine-tuning: mmyatt sft CONFIG [key=value ...]")
    s.add_argument("config")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--run-dir", default=None)

    from mmyatt.rewards.judge_server import add_arguments as add_serve_arguments

    g = sub.add_parser("serve-genrm", help="serve a generative reward model (OpenAI API subset)")
    add_serve_arguments(g)

    b = sub.add_parser("bench", help=f"benchmarks: {', '.join(registry.BENCHES)}, or all of them")
    b.add_argument("name", choices=(*registry.BENCHES, "all"))
    b.add_argument(
        "--out",
        required=True,
        help="JSON file for the measured figures; with `all`, a folder that gets one file "
        "per benchmark (bench/ holds the committed ones: text_grpo.json, ...)",
    )
    b.add_argument("--quick", action="store_true", help="smaller workload (for tests)")

    i = sub.add_parser("inspect", help="summarise a run directory (--html: a full report)")
    i.add_argument("run")
    i.add_argument(
        "--html",
        action="store_true",
        help="also write a self-contained HTML report: curves, histograms, group spread, "
        "best/worst samples with verdicts, judge-vs-check disagreements, every logged sample",
    )
    i.add_argument("--out", default=None, help="the report's path (default RUN/report.html)")

    d = sub.add_parser("demo", help="the main demo job on the embedded default")
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("overrides", nargs="*")

    c = sub.add_parser("_controller", help=argparse.SUPPRESS)
    c.add_argument("config")
    c.add_argument("--run-dir", required=True)

    # overrides may come before or after options: `train CFG --run-dir D a.b=1` works too
    args, extra = p.parse_known_args(argv)
    stray = [
        x for x in extra if x.startswith("-") or "=" not in x or not hasattr(args, "overrides")
    ]
    if stray:
        p.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return dispatch(args)
    except Exception as error:
        line = None if debug else _user_error(error)
        if line is None:
            raise
        print(f"mmyatt: {line}", file=sys.stderr)
        return 2


def dispatch(args) -> int:
    if args.cmd == "train":
        from mmyatt.step.run import train

        return train(args.config, args.overrides, args.run_dir)
    if args.cmd == "_controller":
        from mmyatt.step.run import controller_main

        rc = controller_main(args.config, [], args.run_dir)
        # Everything is written and closed and the process group is destroyed: leave
        # without interpreter teardown, where gloo's threads occasionally abort ("terminate
        # called without an active exception") and turn a finished run into a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    if args.cmd == "sft":
        from mmyatt.step.run import sft_command

        return sft_command(args.config, args.overrides, args.run_dir)
    if args.cmd == "serve-genrm":
        from mmyatt.rewards.judge_server import cli_main

        return cli_main(args)
    if args.cmd == "bench":
        if args.name == "all":
            if Path(args.out).suffix == ".json":
                print(
                    "mmyatt: bench all --out takes a folder, e.g. results/bench/", file=sys.stderr
                )
                return 2
            registry.run_all(args.out, quick=args.quick)
            return 0
        result = registry.run_bench(args.name, quick=args.quick)
        registry.write_result(result, args.out)
        print(json.dumps(result, indent=2))
        return 0
    if args.cmd == "inspect":
        from mmyatt.step.run import print_summary

        run = Path(args.run)
        if not run.is_dir():
            print(f"mmyatt: no run directory at {run}", file=sys.stderr)
            return 2
        print_summary(run)
        if args.html:
            from mmyatt.report.html import write_report

            print(f"[inspect] report written to {write_report(run, args.out)}")
        return 0
    if args.cmd == "demo":
        from mmyatt.step.run import train

        config = Path(__file__).resolve().parents[2] / "configs" / "flow_nft_genrm_tiny.yaml"
        return train(str(config), args.overrides, args.run_dir)
    raise AssertionError(args.cmd)


if __name__ == "__main__":
    sys.exit(main())
