"""The `stillcut` command line.

`stillcut describe VIDEO` answers a prompt about a video (`cli_describe`); `stillcut serve`
runs the HTTP service (`cli_serve`); `stillcut narrate VIDEO` prints running commentary
(`cli_narrate`); `stillcut summarize VIDEO` captions a long video chunk by chunk with times,
then summarises it (`cli_summarize`); `stillcut inspect VIDEO` runs only the vision half of the
pipeline — decode, preprocess, encode, EVS — and prints the token plan, what was decoded, the
token grid and what EVS kept (`--plan`: the plan alone, from the container's index). All use
the trained demo checkpoint shipped with the package unless given `--model`. Heavy imports
wait until a command runs, so `stillcut --help` is instant. The options several commands share
are in `cli_options`.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from stillcut.service import cli_describe, cli_inspect, cli_narrate, cli_serve, cli_summarize

    parser = argparse.ArgumentParser(prog="stillcut", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cli_describe.add_parser(commands)
    cli_narrate.add_parser(commands)
    cli_serve.add_parser(commands)
    cli_summarize.add_parser(commands)
    cli_inspect.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"stillcut: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
