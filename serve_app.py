"""The Ray Serve entrypoint.

    serve run serve_app:app                      # the embedded demo model on :8000
    serve run serve_app:build_app model=/path/to/model tensor_parallel_size=2
    serve run serve_config.yaml
"""

from rayvllm.entrypoints.serve_builder import build_app

app = build_app()

__all__ = ["app", "build_app"]
