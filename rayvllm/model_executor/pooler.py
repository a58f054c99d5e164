"""The pooling runner's output stage: a prompt's final hidden states (after
the model's last norm) -> one vector per request, instead of sampling.

Chunked prefill spreads a prompt over steps, so pooling is incremental:
mean pooling keeps a float32 running sum per request across its chunks and
divides on the last one; last-token pooling reads the final row of the last
chunk. Mean pooling needs every prompt position computed here, which is why
such requests never read the prefix cache (`Request.reads_prefix_cache`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rayvllm.config import PoolerConfig
from rayvllm.model_executor.input_batch import CachedRequestState


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self.mean = config.pooling_type == "MEAN"

    def pool(
        self,
        states: Sequence[CachedRequestState],
        starts: np.ndarray,
        q_lens: np.ndarray,
        cu_q: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, np.ndarray]:
        """Fold this step's rows (request i owns `hidden[cu_q[i]:cu_q[i+1]]`,
        positions from `starts[i]`) into each request; return the float32
        host vector of every request whose prompt ended in this step, as
        numpy: torch tensors sent over a multiprocessing connection (the
        Ray path's channels) travel as shared-memory handles that a process
        of another family cannot open."""
        done: list[str] = []
        vectors: list[torch.Tensor] = []
        normalize: list[bool] = []
        for i, state in enumerate(states):
            rows = hidden[int(cu_q[i]) : int(cu_q[i + 1])]
            if self.mean:
                # A chunk that is not the prompt's first continues a sum.
                assert starts[i] == 0 or state.pooled_sum is not None, "mean pooling missed prompt positions"
                chunk = rows.sum(dim=0, dtype=torch.float32)
                state.pooled_sum = chunk if state.pooled_sum is None else state.pooled_sum + chunk
            if int(starts[i] + q_lens[i]) < state.num_tokens:
                continue  # mid-way through a chunked prefill
            if self.mean:
                assert state.pooled_sum is not None
                vectors.append(state.pooled_sum / state.num_tokens)
            else:
                vectors.append(rows[-1].float())
            params = state.pooling_params
            normalize.append(self.config.normalize if params is None or params.normalize is None else params.normalize)
            done.append(state.req_id)
        if not done:
            return {}
        stacked = torch.stack(vectors)
        mask = torch.tensor(normalize, device=stacked.device)
        stacked = torch.where(mask[:, None], F.normalize(stacked, p=2, dim=-1), stacked)
        # One copy to the host for the batch; each row its own buffer, so a
        # vector pickled alone does not carry the others.
        host = stacked.cpu().numpy()
        return {req_id: host[i].copy() for i, req_id in enumerate(done)}
