"""A toy RL loop around a running rayvllm engine (docs/RL.md): a trainer Ray
actor (torch + transformers, the engine's Llama architecture) runs a few
REINFORCE steps on rollouts from the engine and syncs its weights into it
after each step, alternating the `ray` backend (one object ref the
workers fetch) and `gloo` (a broadcast from the trainer's process). After
each sync the engine's log-probabilities of a fixed sequence must equal the
trainer's own forward in float32.

    python examples/rl_loop.py [--steps 4] [--tp 2]

Everything is local: a seeded random Llama with a locally built tokenizer
(no model hub). The reward is a toy: the share of sampled tokens with an
even id, which the policy learns to raise.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch

from rayvllm import LLM, SamplingParams
from rayvllm.distributed.weight_transfer import TransferGroup, WeightUpdateInfo
from rayvllm.utils.random_model import RandomModelSpec, build_random_model
from rayvllm.worker.worker import free_port

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
        """The weights in the object store, put once (in a list: the caller
        gets the ref, not the value)."""
        return [ray.put(self.weights())]

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


def engine_probe_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    """The engine's log-probability of each token of `ids` after its prefix."""
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]


def sync(llm: LLM, trainer: Any, backend: str, tp: int) -> None:
    if backend == "ray":
        [ref] = ray.get(trainer.put_weights.remote())
        llm.sync_weights(ref, backend="ray")
        return
    # gloo: the trainer hosts the group's store on its node; the engine's
    # workers join it, then receive the broadcast.
    address, port, world_size = ray.util.get_node_ip_address(), free_port(), 1 + tp
    info = ray.get(trainer.update_info.remote())
    sent = trainer.broadcast.remote(address, port, world_size)
    llm.init_weight_transfer_engine("gloo", master_address=address, master_port=port, world_size=world_size)
    llm.start_weight_update()
    llm.update_weights(info)
    ray.get(sent)
    llm.finish_weight_update()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=max(4, args.tp + 2), log_to_driver=False)
    model_dir = str(build_random_model(Path(tempfile.mkdtemp()) / "policy", RandomModelSpec()))
    llm = LLM(model=model_dir, tensor_parallel_size=args.tp, max_num_seqs=16, max_model_len=128,
              kv_cache_memory_bytes=16 << 20, distributed_executor_backend="ray")
    trainer = Trainer.remote(model_dir, args.lr)
    sampling = SamplingParams(temperature=1.0, max_tokens=ROLLOUT_TOKENS, ignore_eos=True)
    try:
        for step in range(args.steps):
            outs = llm.generate(PROMPTS, [sampling.clone(seed=step * 100 + i) for i in range(len(PROMPTS))],
                                use_tqdm=False)
            completions = [list(o.outputs[0].token_ids) for o in outs]
            rewards = [sum(t % 2 == 0 for t in c) / len(c) for c in completions]
            mean_reward = ray.get(trainer.step.remote(PROMPTS, completions, rewards))
            backend = ("ray", "gloo")[step % 2]
            sync(llm, trainer, backend, args.tp)
            engine = engine_probe_logprobs(llm, PROBE)
            trained = ray.get(trainer.probe_logprobs.remote(PROBE))
            gap = max(abs(a - b) for a, b in zip(engine, trained))
            print(f"step {step}: mean reward {mean_reward:.3f}, synced by {backend}, "
                  f"max |engine - trainer| logprob {gap:.2e}")
            assert gap < 1e-4, f"the engine's logprobs left the trainer's after step {step}"
    finally:
        llm.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
