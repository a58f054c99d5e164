"""One source of defaults (issue 26): each engine argument's default and help
live on its config dataclass field, each server option's on `ServerArgs`;
the command line, the Serve builder, the `LLMServer` replica, the offline
`LLM` and docs/CONFIG.md all take them from there."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from rayvllm.config import CPU_KV_CACHE_SPACE_ENV, CacheConfig, SchedulerConfig
from rayvllm.config.engine_args import ENGINE_ARG_GROUPS, EngineArgs, engine_arguments
from rayvllm.config.fields import cli_flag, format_default, parse_value
from rayvllm.config.kv_offload import kv_bytes_per_block
from rayvllm.entrypoints import llm as llm_module
from rayvllm.entrypoints.cli import build_parser, given_args
from rayvllm.entrypoints.config_doc import REGENERATE, render
from rayvllm.entrypoints.llm import LLM
from rayvllm.entrypoints.openai.api_server import LLMServer
from rayvllm.entrypoints.openai.server_args import ServerArgs
from rayvllm.entrypoints.serve_builder import DEMO_MODEL_NAME, build_app, split_args
from rayvllm.messages.errors import InvalidParameterError

REPO = Path(__file__).resolve().parent.parent


def _subparser_actions(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


def _dataclass_default(owner: type, field: str) -> Any:
    return next(f.default for f in dataclasses.fields(owner) if f.name == field)


def test_every_engine_argument_comes_from_a_config_field() -> None:
    """EngineArgs declares nothing of its own: its fields are the config
    dataclasses' arguments, with their types, defaults and help."""
    args = engine_arguments()
    assert list(EngineArgs.model_fields) == [a.name for a in args]
    for arg in args:
        field = EngineArgs.model_fields[arg.name]
        assert field.default == arg.default, arg.name
        assert field.annotation == arg.type, arg.name
        assert field.description == arg.help and arg.help, arg.name
    # Where the argument is the field itself, its default is the field's.
    assert EngineArgs.model_fields["block_size"].default == _dataclass_default(CacheConfig, "block_size") == 16
    assert EngineArgs.model_fields["max_num_seqs"].default == _dataclass_default(SchedulerConfig, "max_num_seqs")
    assert {a.owner for a in args} == set(ENGINE_ARG_GROUPS.values())


def test_each_engine_default_is_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """For every argument: the dataclass's default == EngineArgs' == what
    `rayvllm serve --help` shows (and an unset flag leaves) == what the
    replica of `build_app()` gets == what the offline `LLM()` gets."""
    serve_flags, generate_flags = _subparser_actions("serve"), _subparser_actions("generate")
    cli = EngineArgs.from_dict(given_args(build_parser().parse_args(["serve"]), EngineArgs))
    replica_engine_args = build_app()._bound_deployment.init_args[0]
    replica = EngineArgs.from_dict(replica_engine_args)
    assert set(replica_engine_args) == {"model", "served_model_name", "device"}
    assert replica.served_model_name == DEMO_MODEL_NAME
    # "auto" resolved where `serve run` runs (the replica imports no torch to ask).
    assert replica.device == EngineArgs().resolve_device() != "auto"

    captured: list[EngineArgs] = []

    def capture(args: EngineArgs, **placement: object) -> None:
        # No placement group unless the caller gives one (docs/RL.md).
        assert placement == {"placement_group": None, "placement_group_bundle_indices": None}
        captured.append(args)
        raise RuntimeError("captured")

    monkeypatch.setattr(llm_module, "llm_engine_from_engine_args", capture)
    with pytest.raises(RuntimeError, match="captured"):
        LLM()
    (offline,) = captured

    for arg in engine_arguments():
        default = arg.default
        for flags in (serve_flags, generate_flags):
            action = flags[arg.name]
            assert action.option_strings[0] == cli_flag(arg.name)
            assert action.help is not None and action.help.startswith(arg.help.replace("%", "%%")), arg.name
            assert action.help.endswith(f"(default: {format_default(default)})"), arg.name
        assert EngineArgs.model_fields[arg.name].default == default, arg.name
        assert getattr(cli, arg.name) == default, arg.name
        assert getattr(offline, arg.name) == default, arg.name
        if arg.name not in ("model", "served_model_name", "device"):  # build_app names the demo model and its device
            assert getattr(replica, arg.name) == default, arg.name


def test_each_server_default_is_shared() -> None:
    """For every server option: ServerArgs' default == what `rayvllm serve
    --help` shows == what `build_app()` binds the replica with; LLMServer
    writes no default of its own."""
    bound = build_app()._bound_deployment.init_kwargs
    flags = _subparser_actions("serve")
    assert set(bound) == set(ServerArgs.model_fields)
    for name, field in ServerArgs.model_fields.items():
        assert bound[name] == field.default, name
        assert flags[name].help.endswith(f"(default: {format_default(field.default)})"), name
    params = inspect.signature(LLMServer.func_or_class.__init__).parameters
    assert [p.kind for p in params.values()][-1] is inspect.Parameter.VAR_KEYWORD
    assert all(p.default is inspect.Parameter.empty for p in params.values())
    assert ServerArgs().max_request_bytes == bound["max_request_bytes"] == 16 << 20


def test_serve_run_values_convert_by_field_type() -> None:
    """`serve run serve_app:build_app key=value` hands build_app text; each
    value is converted by its field's type, for the engine and the server."""
    engine, server = split_args({
        "max_num_seqs": "8", "enable_prefix_caching": "false", "gpu_memory_utilization": "0.5",
        "async_scheduling": "none", "kv_offloading_size": "0.25", "enable_lora": "true", "max_loras": "2",
        "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
        "max_request_bytes": "1024", "disable_access_log": "yes", "step_timeout_s": "2.5",
        "lora_modules": "a=/x b=/y",
    })
    assert (engine.max_num_seqs, engine.enable_prefix_caching, engine.gpu_memory_utilization) == (8, False, 0.5)
    assert (engine.async_scheduling, engine.kv_offloading_size, engine.enable_lora) == (None, 0.25, True)
    assert engine.max_loras == 2 and engine.speculative_config == '{"method": "ngram", "num_speculative_tokens": 3}'
    assert (server.max_request_bytes, server.disable_access_log, server.step_timeout_s) == (1024, True, 2.5)
    assert server.lora_modules == "a=/x b=/y"  # text is one of its types: kept for parse_lora_modules


def test_replica_options_pick_the_router_and_put_the_ingress_in_front() -> None:
    """`num_replicas` and `request_router` as `serve run` passes them; more
    than one replica routes by KV (Serve's request-router config) unless
    pow2 is asked for, behind one router ingress (so that `serve run` keeps
    direct ingress: one ingress replica per port); one replica is its own
    ingress."""
    from rayvllm.entrypoints.serve_builder import build_app

    kv_router = "rayvllm.entrypoints.kv_router.KVAwareRequestRouter"  # Serve keeps the class's import path

    def servers(**args: str) -> Any:
        ingress = build_app(args)._bound_deployment  # type: ignore[attr-defined]
        if args.get("num_replicas", "1") == "1":
            assert ingress.name == "LLMServer"
            return ingress
        assert (ingress.name, ingress.num_replicas) == ("OpenAIRouter", 1)
        return ingress.init_args[0]._bound_deployment

    def options(**args: str) -> Any:
        return servers(**args)._deployment_config.request_router_config

    _, server = split_args({"num_replicas": "3", "request_router": "pow2"})
    assert (server.num_replicas, server.request_router) == (3, "pow2")
    assert options(num_replicas="2").request_router_class == kv_router
    assert options(num_replicas="2").request_routing_stats_period_s == 1.0
    assert servers(num_replicas="2").num_replicas == 2
    assert options(num_replicas="2", request_router="pow2").request_router_class != kv_router
    assert options(num_replicas="1").request_router_class != kv_router
    with pytest.raises(InvalidParameterError) as info:
        split_args({"request_router": "random"})
    assert info.value.param == "request_router"


@pytest.mark.parametrize("key, value", [
    ("max_num_seqs", "eight"), ("enable_prefix_caching", "maybe"), ("gpu_memory_utilization", "most"),
    ("max_request_bytes", "1MB"), ("drain_timeout_s", "soon"), ("bogus_key", "1"),
])
def test_bad_serve_run_values_name_their_key(key: str, value: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        split_args({key: value})
    assert info.value.param == key


def test_text_converts_to_lists_and_dicts() -> None:
    assert parse_value("k", list[int] | None, "[1, 2]") == [1, 2]
    assert parse_value("k", list[str], "a, b") == ["a", "b"]
    assert parse_value("k", dict[str, Any] | None, '{"a": 1}') == {"a": 1}
    assert parse_value("k", dict[str, Any] | None, "null") is None
    with pytest.raises(InvalidParameterError, match="^k: not valid JSON"):
        parse_value("k", dict[str, Any], "{a: 1}")
    with pytest.raises(InvalidParameterError, match="^k: expected dict"):
        parse_value("k", dict[str, Any], "[1]")


def test_cli_flag_errors_name_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-seqs", "many"])
    assert "max_num_seqs: expected int, got 'many'" in capsys.readouterr().err


def test_config_doc_is_current() -> None:
    doc = REPO / "docs" / "CONFIG.md"
    assert doc.exists() and doc.read_text() == render(), f"docs/CONFIG.md is stale; regenerate: {REGENERATE}"


def test_cpu_kv_budget_is_the_cache_configs(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    """Without kv_cache_memory_bytes the CPU model runner sizes the KV cache
    by CacheConfig.CPU_KV_CACHE_BYTES, not a number of its own."""
    monkeypatch.delenv(CPU_KV_CACHE_SPACE_ENV, raising=False)  # the suite sets it (conftest)
    config = EngineArgs(model=str(tiny_model_dir), max_model_len=256).create_engine_config()
    mc = config.model_config
    block_size = config.cache_config.block_size
    per_block = kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, block_size, mc.dtype)
    monkeypatch.setattr(CacheConfig, "CPU_KV_CACHE_BYTES", 40 * per_block + per_block // 2)
    llm = LLM(str(tiny_model_dir), max_num_seqs=64, max_model_len=256)
    try:
        assert llm.llm_engine.config.cache_config.num_blocks == 40
    finally:
        llm.shutdown()


def test_cpu_kv_space_variable_sizes_the_cpu_cache(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    """RAYVLLM_CPU_KVCACHE_SPACE (GiB, as vLLM's VLLM_CPU_KVCACHE_SPACE) is
    the CPU cache's budget where kv_cache_memory_bytes is unset; the
    argument wins, a CUDA engine ignores it, and a bad value is an error
    that names it."""
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256)
    mc = args.create_engine_config().model_config
    per_block = kv_bytes_per_block(mc.num_layers, mc.num_kv_heads, mc.head_dim, 16, mc.dtype)
    monkeypatch.setenv(CPU_KV_CACHE_SPACE_ENV, repr(40.5 * per_block / (1 << 30)))
    assert args.create_engine_config().cache_config.kv_cache_memory_bytes == int(40.5 * per_block)
    assert args.resolve_kv_cache_memory_bytes("cuda") is None
    assert EngineArgs(model=str(tiny_model_dir), kv_cache_memory_bytes=123).resolve_kv_cache_memory_bytes("cpu") == 123
    llm = LLM(str(tiny_model_dir), max_num_seqs=64, max_model_len=256)
    try:
        assert llm.llm_engine.config.cache_config.num_blocks == 40
    finally:
        llm.shutdown()
    for bad in ("lots", "0", "-1"):
        monkeypatch.setenv(CPU_KV_CACHE_SPACE_ENV, bad)
        with pytest.raises(InvalidParameterError, match=CPU_KV_CACHE_SPACE_ENV):
            args.create_engine_config()
