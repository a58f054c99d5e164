"""`sync_weights`: vLLM's four weight-transfer phases in one call, for a
Python caller that holds the weights (a trainer's state dict, or a Ray
object ref to one).

`ray`: the weights go to the object store once (a dict given to a core on
Ray; an in-process core takes the dict as it is) and every worker fetches
them itself, taking its TP shard. `gloo` / `nccl`: this process hosts a
transfer group (rank 0, on a free port) that every worker joins, and
broadcasts each tensor from a thread while the engine receives.

Ray-free: the client (core_client.py) puts the weights where its workers
can fetch them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rayvllm.engine.core_client import EngineCoreClient
from rayvllm.messages.errors import InvalidParameterError
from rayvllm.messages.weight_update import WeightUpdateInfo
from rayvllm.utils.network import free_port

if TYPE_CHECKING:
    import torch

    from rayvllm.distributed.weight_transfer import TransferGroup


def sync_weights(client: EngineCoreClient, weights: Any, backend: str = "ray") -> None:
    """Replace the engine's weights by `weights` (HF names -> tensors, every
    tensor of the checkpoint; or, for `ray`, an object ref to such a dict).
    A name, shape or dtype the model does not have raises before any
    weight is written, and the old weights keep serving; after it, the
    prefix cache is reset."""
    # Here, not at the top: every front end imports this module, and the
    # transfer group's torch.distributed is for the callers that sync.
    from rayvllm.distributed.weight_transfer import TransferGroup, check_transfer_backend

    check_transfer_backend(backend)
    call = client.call_utility
    if backend == "ray":
        shared = client.share_weights(weights)
        call("init_weight_transfer_engine", "ray")
        call("start_weight_update")
        call("update_weights", weights=shared)
        call("finish_weight_update")
        return
    if not isinstance(weights, Mapping):
        raise InvalidParameterError(
            "weights", f"{backend} broadcasts a dict of tensors from this process; pass an object ref with backend='ray'"
        )
    pc = client.config.parallel_config
    address, port = client.transfer_address(), free_port()
    world_size = 1 + pc.data_parallel_size * pc.world_size
    sender = _Sender(lambda: TransferGroup(backend, address, port, 0, world_size), weights)
    call("init_weight_transfer_engine", backend, master_address=address, master_port=port, world_size=world_size)
    call("start_weight_update")
    call("update_weights", WeightUpdateInfo.of(weights))
    sender.join()
    call("finish_weight_update")


class _Sender(threading.Thread):
    """Rank 0 of the group: joins it and broadcasts `weights` once, while
    the calling thread drives the engine through the phases. A daemon:
    if the engine never joins, it ends with the group's timeout."""

    def __init__(self, join: Callable[[], TransferGroup], weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__(name="rayvllm-weight-sender", daemon=True)
        self._join = join
        self._weights = weights
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            group = self._join()
            group.send(self._weights)
            group.close()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error
