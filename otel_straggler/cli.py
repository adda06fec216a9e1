"""`otel-straggler` command line: one subcommand per job, each defined next to the code it runs."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Modules are imported only when their command runs, so
# `otel-straggler detect` never pays for torch or matplotlib.
COMMANDS = {
    "demo": ("otel_straggler.demo.demo_command", "run a real multi-rank training job with the detector embedded"),
    "detect": ("otel_straggler.detector.commands", "run the detector service (OTLP/gRPC and OTLP/HTTP in)"),
    "replay": ("otel_straggler.detector.commands", "run the detector offline over OTLP JSON-lines files"),
    "report": ("otel_straggler.report.report_command", "build the HTML report from a detector's evidence directory"),
}


class UsageError(Exception):
    """A bad flag or env var: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="otel-straggler", description="Find the slow rank of a training job.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            getattr(module, f"add_{name}_arguments")(sub)
            sub.set_defaults(_run=getattr(module, f"run_{name}"))
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except UsageError as error:
        print(f"otel-straggler {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
