"""Everything that crosses a process or package boundary: requests and their
parameters, scheduler and model-runner outputs, KV transfer records, block
hashes, engine-core outputs, stats, request outputs and errors.

The bottom of the import graph: nothing here imports another rayvllm package.
"""
