"""A toy RL loop around a running rayvllm engine (docs/RL.md): a trainer Ray
actor (torch + transformers, the engine's Llama architecture) runs a few
REINFORCE steps on rollouts streamed from the serving engine (`AsyncLLM`,
TP=2 on Ray) and syncs its weights into it after each step, alternating the
`ray` backend (one object ref the workers fetch) and `gloo` (a broadcast
from the trainer's process), with the next rollouts in flight, frozen by
`pause_generation(mode="keep", clear_cache=True)`. After each sync the
engine's log-probabilities of a fixed sequence must equal the trainer's own
forward in float32.

    python examples/rl_loop.py [--steps 4] [--tp 2]

Everything is local: a seeded random Llama with a locally built tokenizer
(no model hub). The reward is a toy: the share of sampled tokens with an
even id, which the policy learns to raise.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch

from rayvllm import SamplingParams
from rayvllm.actors.factory import async_llm_from_engine_args
from rayvllm.config.engine_args import EngineArgs
from rayvllm.engine.async_llm import AsyncLLM
from rayvllm.messages.outputs import RequestOutputKind
from rayvllm.distributed.weight_transfer import HostWeights, TransferGroup
from rayvllm.messages.weight_update import WeightUpdateInfo
from rayvllm.utils.random_model import RandomModelSpec, build_random_model
from rayvllm.utils.network import free_port

PROMPTS = [[5 + i, 40 + 3 * i, 90 + i] for i in range(8)]
PROBE = [7, 300, 1200, 55, 2048, 9, 77, 1500]  # the fixed sequence whose logprobs are compared
ROLLOUT_TOKENS = 8


@ray.remote
class Trainer:
    """The policy being trained: the same checkpoint, in transformers."""

    def __init__(self, model_dir: str, lr: float) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def step(self, prompts: list[list[int]], completions: list[list[int]], rewards: list[float]) -> float:
        """One REINFORCE step: raise the log-likelihood of completions that
        scored above the batch's mean."""
        baseline = sum(rewards) / len(rewards)
        self.optimizer.zero_grad()
        for prompt, completion, reward in zip(prompts, completions, rewards):
            ids = torch.tensor([prompt + completion])
            logprobs = torch.log_softmax(self.model(ids).logits[0, :-1], dim=-1)
            taken = logprobs[len(prompt) - 1 :].gather(1, ids[0, len(prompt) :, None]).sum()
            (-(reward - baseline) * taken / len(prompts)).backward()
        self.optimizer.step()
        return baseline

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.model.state_dict().items()}

    def put_weights(self) -> list[Any]:
        """The weights in the object store, put once as numpy arrays that
        each worker maps without a copy (in a list: the caller gets the
        ref, not the value)."""
        return [ray.put(HostWeights.of(self.model.state_dict()))]

    def update_info(self) -> WeightUpdateInfo:
        return WeightUpdateInfo.of(self.weights())

    def broadcast(self, address: str, port: int, world_size: int) -> None:
        """Rank 0 of a gloo group the engine's workers join: send every weight."""
        group = TransferGroup("gloo", address, port, 0, world_size)
        group.send(self.weights())
        group.close()

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        with torch.no_grad():
            logprobs = torch.log_softmax(self.model(torch.tensor([ids])).logits[0, :-1], dim=-1)
        return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


async def rollouts(engine: AsyncLLM, step: int) -> list[list[int]]:
    """One sampled completion per prompt, streamed (seeded per step and prompt)."""

    async def one(i: int, prompt: list[int]) -> list[int]:
        params = SamplingParams(temperature=1.0, max_tokens=ROLLOUT_TOKENS, ignore_eos=True, seed=step * 100 + i)
        tokens: list[int] = []
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"rollout-{step}-{i}"):
            tokens += out.outputs[0].token_ids
        return tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


async def engine_probe_logprobs(engine: AsyncLLM, ids: list[int], step: int) -> list[float]:
    """The engine's log-probability of each token of `ids` after its prefix."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    async for out in engine.generate({"prompt_token_ids": ids}, params, f"probe-{step}", output_kind=RequestOutputKind.FINAL_ONLY):
        assert out.prompt_logprobs is not None
        return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
    raise AssertionError("no output")


async def sync(engine: AsyncLLM, trainer: Any, backend: str, tp: int) -> None:
    if backend == "ray":
        [ref] = await trainer.put_weights.remote()
        await engine.sync_weights(ref, backend="ray")
        return
    # gloo: the trainer hosts the group's store on its node; the engine's
    # workers join it, then receive the broadcast.
    address, port, world_size = ray.util.get_node_ip_address(), free_port(), 1 + tp
    info = await trainer.update_info.remote()
    sent = trainer.broadcast.remote(address, port, world_size)
    await engine.init_weight_transfer_engine("gloo", master_address=address, master_port=port, world_size=world_size)
    await engine.start_weight_update()
    await engine.update_weights(info)
    await sent
    await engine.finish_weight_update()


async def run(args: argparse.Namespace, model_dir: str) -> None:
    engine = async_llm_from_engine_args(EngineArgs(
        model=model_dir, tensor_parallel_size=args.tp, max_num_seqs=16, max_model_len=128,
        kv_cache_memory_bytes=16 << 20, distributed_executor_backend="ray",
    ))
    trainer = Trainer.remote(model_dir, args.lr)
    try:
        batch = await rollouts(engine, 0)
        for step in range(args.steps):
            # The next rollouts run while the trainer learns from these
            # (one step off-policy, as pipelined RL runs).
            following = asyncio.ensure_future(rollouts(engine, step + 1))
            rewards = [sum(t % 2 == 0 for t in c) / len(c) for c in batch]
            mean_reward = await trainer.step.remote(PROMPTS, batch, rewards)
            # Freeze the rollouts in flight, put the new weights in, go on:
            # their KV is recomputed under the new weights (clear_cache).
            await engine.pause_generation(mode="keep", clear_cache=True)
            backend = ("ray", "gloo")[step % 2]
            await sync(engine, trainer, backend, args.tp)
            await engine.resume_generation()
            # (A request made while paused would wait for the resume.)
            engine_logprobs = await engine_probe_logprobs(engine, PROBE, step)
            trained = await trainer.probe_logprobs.remote(PROBE)
            gap = max(abs(a - b) for a, b in zip(engine_logprobs, trained))
            print(f"step {step}: mean reward {mean_reward:.3f}, synced by {backend}, "
                  f"max |engine - trainer| logprob {gap:.2e}")
            assert gap < 1e-4, f"the engine's logprobs left the trainer's after step {step}"
            batch = await following
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=max(4, args.tp + 2), log_to_driver=False)
    try:
        model_dir = str(build_random_model(Path(tempfile.mkdtemp()) / "policy", RandomModelSpec()))
        asyncio.run(run(args, model_dir))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
