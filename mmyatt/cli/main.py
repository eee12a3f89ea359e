"""`mmyatt train | sft | serve-genrm | bench | inspect | demo`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from mmyatt.bench import registry
from mmyatt.cli.user_errors import debugging, user_error_line
from mmyatt.config.schema import ConfigError
from mmyatt.outputs.run_identity import RunDirError, is_run
from mmyatt.report.html import write_report
from mmyatt.serving.server import add_arguments as add_serve_arguments
from mmyatt.serving.server import cli_main as serve_genrm
from mmyatt.step.run import controller_main, sft_command, train
from mmyatt.step.summary import print_summary

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "configs"
DEMO_RECIPE = "flow_nft_genrm_tiny"


def recipes() -> list[str]:
    """The shipped recipes' names (configs/*.yaml without the suffix)."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def resolve_recipe(config: str) -> str:
    """A recipe file, or the name of a shipped one (``text_grpo_tiny``, with or without
    ``.yaml``), as a path."""
    if Path(config).is_file():
        return config
    shipped = RECIPES / (config if config.endswith(".yaml") else f"{config}.yaml")
    if "/" not in config and shipped.is_file():
        return str(shipped)
    raise ConfigError(
        f"no recipe {config!r}: not a file, nor a shipped recipe ({', '.join(recipes())})"
    )


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake on the command line answered by one line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _recipe_help() -> str:
    return (
        "CONFIG is a recipe: a YAML file, or the name of a shipped one:\n  "
        + "\n  ".join(recipes())
        + "\nkey=value overrides (optional) change any setting of it, e.g. trainer.steps=20 "
        "algorithm.kl_coef=0.01;\nevery setting, its default and meaning: docs/configuration.md"
    )


def _add_run_arguments(parser: argparse.ArgumentParser, *, recipe: bool = True) -> None:
    if recipe:
        parser.add_argument("config", metavar="CONFIG", help="a recipe file or name (below)")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="key=value",
        help="optional dotted overrides, e.g. algorithm.kl_coef=0.01",
    )
    parser.add_argument("--run-dir", default=None, help="where the run goes (default runs/<name>)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run directory that holds another run (it is deleted)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run a run directory holds, with the model, data and recipe it "
        "was made with",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (it is saved as RUN_DIR/config.yaml either way)",
    )


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="mmyatt",
        description=__doc__,
        epilog="--debug (anywhere): show the traceback of errors in config, data or files",
    )
    commands = "{train,sft,serve-genrm,bench,inspect,demo}"
    sub = p.add_subparsers(dest="cmd", required=True, metavar=commands)
    recipe_help = dict(epilog=_recipe_help(), formatter_class=argparse.RawDescriptionHelpFormatter)

    t = sub.add_parser(
        "train",
        help="RL training run: mmyatt train CONFIG [key=value ...]",
        description="An RL training run of a recipe.",
        **recipe_help,
    )
    _add_run_arguments(t)

    s = sub.add_parser(
        "sft",
        help="supervised fine-tuning: mmyatt sft CONFIG [key=value ...]",
        description="Supervised fine-tuning of a recipe's model on its data.",
        **recipe_help,
    )
    s.add_argument("config", metavar="CONFIG", help="a recipe file or name (below)")
    s.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="optional")
    s.add_argument("--run-dir", default=None)

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

    d = sub.add_parser(
        "demo",
        help=f"the main demo job on the embedded default (the {DEMO_RECIPE} recipe)",
        description=f"The {DEMO_RECIPE} recipe, with optional overrides.",
    )
    _add_run_arguments(d, recipe=False)
    d.set_defaults(run_dir="runs/demo")
    return p


def configure_logging() -> None:
    """The library's messages (``mmyatt.*`` loggers) as plain lines on stdout; warnings
    say so."""
    log = logging.getLogger("mmyatt")
    if log.handlers:
        return
    handler = _Stdout()
    handler.setFormatter(_Plain())
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if debugging() else logging.INFO)


class _Stdout(logging.StreamHandler):
    """Whatever ``sys.stdout`` is when a message is written (a captured or replaced
    stdout included), not the one there was when logging was configured."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _):
        pass


class _Plain(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {text}"
        return text


def main(argv: list[str] | None = None) -> int:
    """The CLI. Errors the user caused print one line and exit 2, whichever process found
    them; ``--debug`` (anywhere on the command line, or MMYATT_DEBUG=1, which
    controllers inherit) shows the traceback instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ["MMYATT_DEBUG"] = "1"
    configure_logging()
    if argv[:1] == ["_controller"]:  # one of the controllers `train` starts; not for users
        return controller(argv[1:])
    p = parser()
    # overrides may come before or after options: `train CFG --run-dir D a.b=1` works too
    args, extra = p.parse_known_args(argv)
    try:
        options = [x for x in extra if x.startswith("-")]
        if options or (extra and not hasattr(args, "overrides")):
            p.error(f"unrecognized arguments: {' '.join(options or extra)}")
        if extra:
            args.overrides = [*args.overrides, *extra]
        for override in getattr(args, "overrides", []):
            if "=" not in override:
                raise ConfigError(f"override {override!r} must look like key.sub=value")
        return dispatch(args)
    except Exception as error:
        line = None if debugging() else user_error_line(error)
        if line is None:
            raise
        print(f"mmyatt: {line}", file=sys.stderr)
        return 2


def controller(argv: list[str]) -> int:
    """``mmyatt _controller CONFIG --run-dir D``: one controller of a launched run. It
    leaves without interpreter teardown: everything is written and closed and the process
    group is destroyed, and gloo's threads occasionally abort at teardown ("terminate
    called without an active exception"), which would turn a finished run into a failure."""
    p = argparse.ArgumentParser(prog="mmyatt _controller")
    p.add_argument("config")
    p.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)
    rc = controller_main(args.config, [], args.run_dir, launcher_reports=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def dispatch(args) -> int:
    if args.cmd in ("train", "demo"):
        config = resolve_recipe(DEMO_RECIPE if args.cmd == "demo" else args.config)
        return train(
            config,
            args.overrides,
            args.run_dir,
            overwrite=args.overwrite,
            resume=args.resume,
            print_config=args.print_config,
        )
    if args.cmd == "sft":
        return sft_command(resolve_recipe(args.config), args.overrides, args.run_dir)
    if args.cmd == "serve-genrm":
        return serve_genrm(args)
    if args.cmd == "bench":
        if args.name == "all":
            if Path(args.out).suffix == ".json":
                raise ConfigError("bench all --out takes a folder, e.g. results/bench/")
            registry.run_all(args.out, quick=args.quick)
            return 0
        result = registry.run_bench(args.name, quick=args.quick)
        registry.write_result(result, args.out)
        print(json.dumps(result, indent=2))
        return 0
    if args.cmd == "inspect":
        run = Path(args.run)
        if not run.is_dir():
            raise RunDirError(f"no run directory at {run}")
        if not (is_run(run) or (run / "metrics.jsonl").is_file()):
            raise RunDirError(f"{run} is not a run directory (no config.yaml or metrics.jsonl)")
        print_summary(run)
        if args.html:
            print(f"[inspect] report written to {write_report(run, args.out)}")
        return 0
    raise AssertionError(args.cmd)


if __name__ == "__main__":
    sys.exit(main())
