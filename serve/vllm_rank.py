"""One pool's vLLM ranks on this host, through vLLM's own `serve` command and argument parser: the
OpenAI server on the head, engine ranks only (`--headless`) elsewhere. Run as
`python -P -m serve.vllm_rank ARGS` (appliance.engine_launch builds ARGS): the CPU build's `vllm`
console script fails on its package metadata, so neither build is started through it.
"""

from __future__ import annotations


def main() -> None:
    # vLLM is imported here, not at module level: importing it takes seconds and starts nothing.
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()  # type: ignore[no-untyped-call]
    parser = FlexibleArgumentParser(prog="serve.vllm_rank")  # type: ignore[no-untyped-call]
    args = make_arg_parser(parser).parse_args()
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
