"""Who may call which route: `ServerArgs.access` (the planes a server
mounts and the keys each takes), the refusals at start, and `authorize`
on real starlette requests. The servers that apply them are tested over
HTTP in test_serve_app.py, test_serve_entrypoints.py and test_kv_router.py."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from rayvllm.entrypoints.openai.http_route import authorize
from rayvllm.entrypoints.openai.server_args import Plane, ServerArgs
from rayvllm.messages.errors import AuthenticationError, InvalidParameterError


def _request(authorization: str | None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "POST", "path": "/pause", "headers": headers, "query_string": b""})


def _allowed(keys: tuple[str, ...], authorization: str | None) -> bool:
    try:
        authorize(_request(authorization), keys)
    except AuthenticationError:
        return False
    return True


def test_by_default_only_the_api_is_mounted_and_it_is_open() -> None:
    access = ServerArgs().access()
    assert access.planes == {Plane.API}
    assert access.keys(Plane.API) == ()
    assert ServerArgs().open_planes_warning() is None


@pytest.mark.parametrize("option", ["enable_control_plane", "allow_runtime_lora_updating"])
def test_a_plane_that_changes_the_server_needs_a_key_or_a_private_port(option: str) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        ServerArgs.from_dict({option: "true"})
    message = str(refused.value)
    assert option in message and "admin_api_key" in message and "api_key" in message
    assert "port_is_private" in message
    private = ServerArgs.from_dict({option: "true", "port_is_private": "true"})
    warning = private.open_planes_warning()
    assert warning is not None and option in warning and "port_is_private" in warning
    assert not private.access().keys(Plane.CONTROL if option == "enable_control_plane" else Plane.ADAPTERS)
    assert ServerArgs.from_dict({option: "true", "api_key": "k"}).open_planes_warning() is None


@pytest.mark.parametrize("options", [{"admin_api_key": "a"}, {"port_is_private": True}])
def test_an_admin_option_without_an_admin_plane_is_refused(options: dict[str, object]) -> None:
    with pytest.raises(InvalidParameterError, match="enable_control_plane, allow_runtime_lora_updating"):
        ServerArgs.from_dict(options)


def test_the_admin_key_guards_the_control_plane_and_the_api_key_does_not() -> None:
    access = ServerArgs(enable_control_plane=True, allow_runtime_lora_updating=True, api_key="user",
                        admin_api_key="admin").access()
    assert access.planes == {Plane.API, Plane.CONTROL, Plane.ADAPTERS}
    for plane in (Plane.CONTROL, Plane.ADAPTERS):
        keys = access.keys(plane)
        assert _allowed(keys, "Bearer admin")
        assert not _allowed(keys, "Bearer user")
        assert not _allowed(keys, None)
        assert not _allowed(keys, "Bearer admin ")
    api = access.keys(Plane.API)
    assert _allowed(api, "Bearer user") and _allowed(api, "Bearer admin") and not _allowed(api, None)


def test_without_an_admin_key_the_api_key_guards_the_control_plane() -> None:
    access = ServerArgs(enable_control_plane=True, api_key="user").access()
    assert _allowed(access.keys(Plane.CONTROL), "Bearer user")
    assert not _allowed(access.keys(Plane.CONTROL), "Bearer other")
    # An admin key alone: the API stays open, the control plane does not.
    admin_only = ServerArgs(enable_control_plane=True, admin_api_key="admin").access()
    assert admin_only.keys(Plane.API) == ()
    assert not _allowed(admin_only.keys(Plane.CONTROL), None)
