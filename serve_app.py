"""The Ray Serve entrypoint.

    serve run serve_app:app                      # the embedded demo model on :8000
    serve run serve_app:build_app model=/path/to/model tensor_parallel_size=2
    serve run serve_config.yaml
"""

from rayvllm.entrypoints.serve_builder import build_app, start_fast_serve_run

# `serve run serve_app:app`, on a fresh machine or a running cluster where
# Serve does not run yet: the replica itself answers :8000 (Serve's direct
# ingress) and Serve's proxy moves to :8001.
start_fast_serve_run()
app = build_app()

__all__ = ["app", "build_app"]
