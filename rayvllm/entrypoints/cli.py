"""`rayvllm` command line: `rayvllm generate "Hello"` runs the offline engine;
`rayvllm serve [--model DIR] [engine flags]` serves the OpenAI API with Ray
Serve (the same app as `serve run serve_app:build_app`)."""

from __future__ import annotations

import argparse
import json
import sys
import typing
from collections.abc import Sequence
from types import UnionType
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rayvllm.config.engine_args import EngineArgs
from rayvllm.config.fields import cli_flag, format_default, parse_value
from rayvllm.entrypoints.openai.server_args import ServerArgs
from rayvllm.messages.errors import InvalidParameterError, RayvllmError


class _ArgType:
    """Converts a flag's text by its field's type, as `serve run key=value`
    is converted (`parse_value`), naming the field in errors."""

    def __init__(self, name: str, annotation: Any) -> None:
        self.name, self.annotation = name, annotation

    def __call__(self, text: str) -> Any:
        try:
            return parse_value(self.name, self.annotation, text)
        except InvalidParameterError as e:
            raise argparse.ArgumentTypeError(str(e)) from None


def flag_help(field: FieldInfo) -> str:
    """A flag's help: the field's, and the default an unset flag leaves."""
    return f"{field.description or ''} (default: {format_default(field.default)})".replace("%", "%%")


def add_model_args(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """One `--flag` per field of `model` (vLLM's dashes), typed from it; an
    unset flag leaves the field's own default (which its help shows)."""
    for name, field in model.model_fields.items():
        flag, help = cli_flag(name), flag_help(field)
        annotation = field.annotation
        members = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, UnionType) else ()
        base = next((a for a in members if a is not type(None)), annotation)
        if base is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help)
        elif typing.get_origin(base) is list:
            parser.add_argument(flag, dest=name, nargs="+", type=typing.get_args(base)[0], default=None, help=help)
        else:
            parser.add_argument(flag, dest=name, type=_ArgType(name, annotation), default=None, help=help)


def given_args(ns: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The fields of `model` set on the command line."""
    return {k: v for k, v in vars(ns).items() if k in model.model_fields and v is not None}


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs.from_dict(given_args(ns, EngineArgs))


def _generate(ns: argparse.Namespace) -> int:
    from rayvllm.entrypoints.llm import LLM
    from rayvllm.messages.sampling_params import SamplingParams

    args = engine_args_from(ns)
    llm = LLM(**args.model_dump(exclude_unset=True))
    params = SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.sampling_seed
    )
    outputs = llm.generate(ns.prompts, params, use_tqdm=False)
    for out in outputs:
        if ns.json:
            print(json.dumps({"prompt": out.prompt, "text": out.outputs[0].text,
                              "token_ids": out.outputs[0].token_ids,
                              "finish_reason": out.outputs[0].finish_reason}))
        else:
            print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    return 0


def _serve(ns: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from rayvllm.entrypoints.serve_builder import (
        DEFAULT_APP_NAME, build_app, join_with_direct_ingress, start_with_direct_ingress,
    )

    args = {**engine_args_from(ns).model_dump(exclude_unset=True), **given_args(ns, ServerArgs)}
    app = build_app(args)
    if ns.direct_ingress and ns.address is None:
        # This command starts the cluster, so it can give it the settings
        # that put the replica itself on --port (the proxy moves aside).
        start_with_direct_ingress(ns.port, ns.host, ns.proxy_port)
    elif not (ns.direct_ingress and join_with_direct_ingress(ns.address, ns.port, ns.host, ns.proxy_port)):
        # No direct ingress, or Serve already runs on that cluster with its own settings.
        ray.init(address=ns.address)
        serve.start(http_options={"host": ns.host, "port": ns.port})
    try:
        serve.run(app, name=DEFAULT_APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM: stop the app, its replica draining in-flight
        # requests (drain_timeout_s), before the cluster goes.
        serve.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayvllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts offline")
    gen.add_argument("prompts", nargs="+", help="prompt strings")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="one JSON object per line")
    add_model_args(gen, EngineArgs)
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API with Ray Serve")
    srv.add_argument("--host", default="0.0.0.0", help="the address to serve on (default: %(default)s)")
    srv.add_argument("--port", type=int, default=8000, help="the port to serve on (default: %(default)s)")
    srv.add_argument("--address", default=None,
                     help="join this Ray cluster ('auto': the one running here); default: start a local one")
    srv.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=True,
                     help="the replica answers --port itself, without Serve's proxy hop, on a cluster this "
                          "command starts or joins where Serve does not yet run (default: on)")
    srv.add_argument("--proxy-port", type=int, default=None,
                     help="Serve's HTTP proxy port (default: --port + 1 with direct ingress, else --port)")
    add_model_args(srv, ServerArgs)
    add_model_args(srv, EngineArgs)
    srv.set_defaults(func=_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except RayvllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
