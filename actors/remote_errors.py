"""Remote errors as their own exceptions, for every Ray caller (the core
client and the executors alike; this module imports no engine code)."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayTaskError


def get_unwrapped(refs: Any) -> Any:
    """`ray.get`, raising a remote error as the exception its task raised
    (its type and message, e.g. a 400's `InvalidParameterError`), not
    wrapped in Ray's traceback."""
    try:
        return ray.get(refs)
    except RayTaskError as e:
        cause = e.cause
        if isinstance(cause, BaseException):
            raise cause from None
        raise
