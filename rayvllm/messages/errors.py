"""Exception hierarchy shared by the engine and its entrypoints.

Every error a client can cause derives from `RayvllmError` and carries the
HTTP status the OpenAI-compatible server answers with, so one mapping serves
the offline API, the Python handle and the HTTP app.
"""

from __future__ import annotations

from typing import Any


class RayvllmError(Exception):
    """Base class; `status_code` is the HTTP status an API server returns,
    `public_message` what its error body says (the full text goes to the
    server's log only, where it may name nodes and internals)."""

    status_code: int = 500
    error_type: str = "internal_error"

    @property
    def public_message(self) -> str:
        return str(self) or type(self).__name__

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by its state, not its constructor's arguments (which a
        subclass may change), so it crosses processes (a Ray task's error)
        with its type and message."""
        return (_restore_error, (type(self), self.args, self.__dict__))


def _restore_error(cls: type[RayvllmError], args: tuple[Any, ...], state: dict[str, Any]) -> RayvllmError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidParameterError(RayvllmError, ValueError):
    """A request field holds a value outside its domain; `param` names it."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class PromptTooLongError(InvalidParameterError):
    """The prompt (plus what must be generated) does not fit `max_model_len`."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__(
            "prompt",
            f"the prompt has {num_tokens} tokens; it must be shorter than max_model_len={max_model_len} "
            "to leave room for output",
        )
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len


class AuthenticationError(RayvllmError):
    status_code = 401
    error_type = "authentication_error"


class ModelNotFoundError(RayvllmError):
    status_code = 404
    error_type = "not_found_error"


class EngineOverloadedError(RayvllmError):
    status_code = 503
    error_type = "service_unavailable"


class EngineDeadError(RayvllmError):
    status_code = 503
    error_type = "service_unavailable"

    @property
    def public_message(self) -> str:
        # The cause names worker ranks, nodes and addresses.
        return "the engine is not available; retry later"


class StepFailedError(EngineDeadError):
    """A step raised on a worker that is still alive. `culprits`: the
    requests first scheduled in that step that had produced no token yet
    (anything they carry may be the cause); the others ran before."""

    def __init__(self, message: str, culprits: list[str]) -> None:
        super().__init__(message)
        self.culprits = culprits


class RequestFailedError(RayvllmError):
    """This request's step failed on the engine; the engine went on."""

    status_code = 500
    error_type = "internal_error"

    @property
    def public_message(self) -> str:
        return "the engine failed to run this request"


class RequestTooLargeError(RayvllmError):
    """A request body over the server's `max_request_bytes`."""

    status_code = 413
    error_type = "invalid_request_error"


class PlacementError(RayvllmError):
    """A worker group's placement group could not be placed in time; the
    message names the bundles asked for and what the cluster has free.
    `pending_group`: the group, left in place for a caller that waits on it
    again (None where it was removed)."""

    status_code = 503
    error_type = "service_unavailable"
    pending_group: Any = None


class DistributedInitError(RayvllmError):
    """A process group did not form or failed its preflight; the message
    names the ranks (and their nodes) that did not answer."""

    status_code = 503
    error_type = "service_unavailable"
