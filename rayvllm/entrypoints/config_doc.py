"""docs/CONFIG.md, written from the one source of every default and help
text: the config dataclasses' fields (through `EngineArgs`), `ServerArgs`
and the batch processor's `EngineProcessorConfig`.

    python -m rayvllm.entrypoints.config_doc > docs/CONFIG.md
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from rayvllm.config.engine_args import ENGINE_ARG_GROUPS, NESTED_ARG_GROUPS
from rayvllm.config.fields import Argument, cli_flag, format_default, type_name, user_arguments
from rayvllm.data.config import EngineProcessorConfig
from rayvllm.entrypoints.openai.server_args import ServerArgs

REGENERATE = "python -m rayvllm.entrypoints.config_doc > docs/CONFIG.md"

_HEADER = f"""# Configuration

Every argument of the engine and of the OpenAI server, with its type,
default and meaning. The same names work everywhere: as keywords of
`LLM(...)` and `EngineArgs(...)`, as `key=value` after `serve run
serve_app:build_app`, under `args:` in a Serve config file, and as
`rayvllm serve --flag` (vLLM's dashes). Text values (`serve run`, a flag)
are converted by the type: `true`/`false`, numbers, `none`, JSON objects,
lists as JSON or comma-separated.

Generated from the config dataclasses, `ServerArgs` and
`EngineProcessorConfig`; do not edit by hand,
regenerate with `{REGENERATE}`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(name: str, annotation: Any, default: Any, flag: str, help: str) -> str:
    cells = [f"`{name}`", f"`{type_name(annotation)}`", f"`{format_default(default)}`", flag, help]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _table(title: str, rows: list[str], intro: str = "", given_as: str = "CLI flag") -> list[str]:
    head = [f"| Argument | Type | Default | {given_as} | Help |", "|---|---|---|---|---|"]
    return [f"## {title}", "", *([intro, ""] if intro else []), *head, *rows, ""]


def _engine_rows(args: list[Argument]) -> list[str]:
    return [_row(a.name, a.type, a.default, f"`{cli_flag(a.name)}`", a.help) for a in args]


def _nested_rows(parent: str, args: list[Argument]) -> list[str]:
    return [_row(a.name, a.type, a.default, f"`{cli_flag(parent)}` key", a.help) for a in args]


def _server_rows(model: type[BaseModel]) -> list[str]:
    return [
        _row(name, f.annotation, f.default, f"`{cli_flag(name)}`", f.description or "")
        for name, f in model.model_fields.items()
    ]


def _keyword_rows(model: type[BaseModel]) -> list[str]:
    return [
        _row(name, f.annotation, f.get_default(call_default_factory=True), f"`{name}=`", f.description or "")
        for name, f in model.model_fields.items()
    ]


def render() -> str:
    """The whole of docs/CONFIG.md."""
    lines = [_HEADER]
    for title, cls in ENGINE_ARG_GROUPS.items():
        lines += _table(f"{title} ({cls.__name__})", _engine_rows(user_arguments(cls)))
    for parent, cls in NESTED_ARG_GROUPS.items():
        intro = f"The keys of the JSON object that `{parent}` takes."
        lines += _table(f"`{parent}` keys ({cls.__name__})", _nested_rows(parent, user_arguments(cls)), intro)
    lines += _table(
        "Server (ServerArgs)", _server_rows(ServerArgs),
        "The OpenAI server's own options (`serve run`, `rayvllm serve`); the offline `LLM` has none.",
    )
    lines += _table(
        "Batch processor (EngineProcessorConfig)", _keyword_rows(EngineProcessorConfig),
        "`rayvllm.data.EngineProcessorConfig(...)`, Ray Data LLM's names ([BATCH.md](BATCH.md)).", "Keyword",
    )
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
