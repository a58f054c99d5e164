"""Deployment files in infra/ parse, fit together, and match the code.

The Grafana dashboard and the Prometheus config may only query metric
samples that `EngineMetrics.render()` really exposes, and the dashboard must
show every metric family it exports, so neither side can drift silently.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rayvllm.config.engine_args import EngineArgs
from rayvllm.frontend.metrics import EngineMetrics

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
# A metric name in our namespace inside PromQL or YAML text.
METRIC_RE = re.compile(r"rayvllm:[A-Za-z0-9_:]+")
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def exported_samples() -> tuple[set[str], set[str]]:
    """(sample names, family names) that a fresh EngineMetrics exposes,
    without prometheus_client's `_created` series (nothing should chart them)."""
    body, _ = EngineMetrics("m").render()
    families = [f for f in text_string_to_metric_families(body.decode()) if not f.name.endswith("_created")]
    return {s.name for f in families for s in f.samples}, {f.name for f in families}


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuations joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in (INFRA / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, even inside a continuation
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "Dockerfile ends inside a line continuation"
    return [(ins.upper(), args.strip()) for ins, _, args in (item.partition(" ") for item in logical)]


def expand_args(text: str, defaults: dict[str, str]) -> str:
    """`${NAME}` / `$NAME` replaced by the ARG defaults (what a plain build gets)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m.group(1) or m.group(2), m.group(0)), text)


def test_dockerfile_base_install_ports_and_cmd() -> None:
    instructions = dockerfile_instructions()
    arg_defaults = dict(
        args.split("=", 1) for ins, args in instructions if ins == "ARG" and "=" in args
    )
    froms = [expand_args(a, arg_defaults) for ins, a in instructions if ins == "FROM"]
    assert froms == ["python:3.11-slim"]

    runs = [expand_args(a, arg_defaults) for ins, a in instructions if ins == "RUN"]
    torch_pin = next(
        d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("torch")
    )
    assert torch_pin == "torch==2.13.0"
    assert any(f"pip install {torch_pin} --index-url {CPU_TORCH_INDEX}" in r for r in runs), runs
    # torch before the project, so `pip install .` finds the CPU build in place.
    torch_at = next(i for i, r in enumerate(runs) if f"pip install {torch_pin}" in r)
    project_at = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_at < project_at

    exposed = {port for ins, a in instructions if ins == "EXPOSE" for port in a.split()}
    assert {"8000", "8265"} <= exposed

    cmds = [json.loads(a) for ins, a in instructions if ins == "CMD"]
    assert cmds == [["serve", "run", "serve_app:app"]]
    entrypoints = [json.loads(a) for ins, a in instructions if ins == "ENTRYPOINT"]
    assert entrypoints == [["docker-entrypoint.sh"]]
    assert any("infra/docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh" in r for r in runs)


def test_dockerfile_passes_hadolint() -> None:
    """No image is built in CI (no Docker engine); the Dockerfile is linted."""
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (the dev extra brings it on Linux)")
    result = subprocess.run([hadolint, "--failure-threshold", "info", str(INFRA / "Dockerfile")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_entrypoint_script_is_valid_sh_and_passes_commands_through(tmp_path: Path) -> None:
    script = INFRA / "docker-entrypoint.sh"
    assert script.stat().st_mode & 0o111, "docker-entrypoint.sh must be executable"
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    subprocess.run([sh, "-n", str(script)], check=True)
    # A non-serve command is exec'd unchanged, without starting Ray.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "ray").write_text("#!/bin/sh\necho RAY-STARTED \"$@\"\n")
    (fake_bin / "ray").chmod(0o755)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin"}
    out = subprocess.run([sh, str(script), "echo", "hi"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "hi\n"
    # A serve command gets a head node first, then runs against it.
    serve = fake_bin / "serve"
    serve.write_text("#!/bin/sh\necho serve \"$RAY_ADDRESS\" \"$@\"\n")
    serve.chmod(0o755)
    cmd = [sh, str(script), "serve", "run", "serve_app:app"]
    lines = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[0].startswith("RAY-STARTED start --head")
    assert "--dashboard-host=0.0.0.0" in shlex.split(lines[0])
    assert lines[1] == "serve auto run serve_app:app"
    # With a cluster already named, serve goes straight to it.
    out = subprocess.run(cmd, env={**env, "RAY_ADDRESS": "ray://head:10001"}, capture_output=True, text=True, check=True)
    assert out.stdout == "serve ray://head:10001 run serve_app:app\n"


# ---------------------------------------------------------------- KubeRay


def load_rayservice() -> dict[str, Any]:
    doc = yaml.safe_load((INFRA / "kuberay" / "rayservice.yaml").read_text())
    assert isinstance(doc, dict)
    return doc


def test_rayservice_runs_build_app_with_engine_args() -> None:
    doc = load_rayservice()
    assert doc["apiVersion"] == "ray.io/v1"
    assert doc["kind"] == "RayService"
    # serveConfigV2 is a string holding YAML, exactly as KubeRay expects.
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    assert app["import_path"] == "serve_app:build_app"
    assert app["args"]["model"].startswith("/models/")
    assert app["args"]["tensor_parallel_size"] == 1
    # Every arg is an engine arg build_app accepts.
    assert set(app["args"]) <= set(EngineArgs.model_fields)
    assert serve_config["http_options"]["port"] == 8000


def test_rayservice_cluster_groups() -> None:
    cluster = load_rayservice()["spec"]["rayClusterConfig"]
    assert isinstance(cluster["rayVersion"], str)
    head = cluster["headGroupSpec"]
    workers = cluster["workerGroupSpecs"]
    assert len(workers) >= 1
    for group in [head, *workers]:
        # KubeRay passes rayStartParams as `--key=value` strings.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        (container,) = group["template"]["spec"]["containers"]
        assert {"requests", "limits"} <= set(container["resources"])
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["models"] == "/models"
        volumes = {v["name"] for v in group["template"]["spec"]["volumes"]}
        assert set(mounts) <= volumes
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {6379, 8265, 8000, 8080} <= head_ports
    for group in workers:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


# ---------------------------------------------------------------- Prometheus


def test_prometheus_scrapes_app_and_ray() -> None:
    text = (INFRA / "prometheus" / "prometheus.yml").read_text()
    config = yaml.safe_load(text)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    app_job = jobs["rayvllm"]
    assert app_job.get("metrics_path", "/metrics") == "/metrics"
    app_targets = [t for sc in app_job["static_configs"] for t in sc["targets"]]
    assert app_targets and all(t.endswith(":8000") for t in app_targets)
    ray_targets = [t for sc in jobs["ray"]["static_configs"] for t in sc["targets"]]
    assert ray_targets and all(t.endswith(":8080") for t in ray_targets)
    sample_names, _ = exported_samples()
    assert set(METRIC_RE.findall(text)) <= sample_names


# ---------------------------------------------------------------- Grafana


def load_dashboard() -> dict[str, Any]:
    dash = json.loads((INFRA / "grafana" / "rayvllm-dashboard.json").read_text())
    assert isinstance(dash, dict)
    return dash


def dashboard_queries(dash: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and templating queries."""
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def test_dashboard_queries_only_exported_metrics_and_shows_them_all() -> None:
    dash = load_dashboard()
    referenced = {name for expr in dashboard_queries(dash) for name in METRIC_RE.findall(expr)}
    sample_names, family_names = exported_samples()
    assert referenced, "the dashboard queries no rayvllm metric"
    assert referenced <= sample_names, f"not exported: {sorted(referenced - sample_names)}"
    # A family counts as shown when one of its samples is queried
    # (`_bucket` for histograms, `_total` for counters, the name for gauges).
    unshown = {f for f in family_names if not any(r == f or r.startswith(f + "_") for r in referenced)}
    assert not unshown, f"exported but not on the dashboard: {sorted(unshown)}"


def test_dashboard_latency_panels_have_p50_and_p99() -> None:
    exprs = dashboard_queries(load_dashboard())
    for histogram in (
        "rayvllm:time_to_first_token_seconds",
        "rayvllm:time_per_output_token_seconds",
        "rayvllm:e2e_request_latency_seconds",
        "rayvllm:request_queue_time_seconds",
    ):
        quantiles = {
            float(m.group(1))
            for e in exprs
            for m in re.finditer(rf"histogram_quantile\(([0-9.]+),.*\brate\({re.escape(histogram)}_bucket\b", e)
        }
        assert quantiles == {0.5, 0.99}, (histogram, quantiles)
    hit_rate = [e for e in exprs if "prefix_cache_hits_total" in e]
    assert hit_rate and all("/" in e and "prefix_cache_queries_total" in e for e in hit_rate)


def test_dashboard_structure() -> None:
    dash = load_dashboard()
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model_name"} <= variables
    for p in panels:
        assert p["targets"], p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            # Filtered by the Model variable, so multi-model setups split cleanly.
            for name in METRIC_RE.findall(t["expr"]):
                assert f'{name}{{model_name=~"$model_name"}}' in t["expr"], (p["title"], name)


# ---------------------------------------------------------------- cluster launcher


def ray_schema() -> dict[str, Any]:
    import ray

    return json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())


LAUNCHER_CONFIGS = [ROOT / "cluster.yaml", INFRA / "cluster-local.yaml"]


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_cluster_launcher_config_passes_rays_schema(path: Path) -> None:
    import jsonschema

    jsonschema.validate(yaml.safe_load(path.read_text()), ray_schema())


def _pinned_ray(text: str) -> set[str]:
    return set(re.findall(r"ray\[[a-z,]+\]==([0-9.]+)", text))


@pytest.mark.parametrize("path", LAUNCHER_CONFIGS, ids=lambda p: p.name)
def test_cluster_launcher_config_installs_what_its_commands_run(path: Path) -> None:
    """Ray is pinned to the project's version, a C compiler is present for
    the CPU kernels, every Ray or Serve command runs from the virtualenv the
    setup made, and the head deploys the Serve config."""
    config = yaml.safe_load(path.read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = _pinned_ray(" ".join(project["project"]["dependencies"]))
    setup = " ".join(config.get("setup_commands", []) + config.get("head_setup_commands", []))
    assert _pinned_ray(setup) == {pin}
    assert "build-essential" in setup and "python3-venv" in setup
    # uv from PyPI (pinned): its installer script's host may be out of reach.
    assert re.search(r"pip install uv==[0-9.]+", setup) and "astral.sh" not in path.read_text()
    venv = re.search(r"uv venv (?:--\S+ )*--python 3.11 (\S+)", setup).group(1)
    # The venv on the login shell's PATH: `ray down` runs a plain `ray stop` on the head.
    assert any(f"{venv.replace('~', '$HOME')}/bin:$PATH" in c and ".bashrc" in c for c in config["setup_commands"])
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    for command in starts:
        for word in re.findall(r"\S*\b(?:ray|serve) (?:start|stop|deploy)", command):
            assert word.startswith(f"{venv}/bin/"), command
    assert any("serve deploy serve_config.yaml" in c for c in config["head_start_ray_commands"])
    assert (ROOT / "serve_config.yaml").exists()


def test_rayservice_app_is_the_default_one_with_a_bounded_context() -> None:
    from rayvllm.entrypoints.serve_builder import DEFAULT_APP_NAME

    service = yaml.safe_load((INFRA / "kuberay" / "rayservice.yaml").read_text())
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["name"] == DEFAULT_APP_NAME
    assert EngineArgs.from_dict(app["args"]).max_model_len is not None


def test_rayservice_serves_the_app_of_serve_config() -> None:
    """serve_config.yaml and the RayService's serveConfigV2 describe the
    same application (name, route, import path, HTTP port); only the model
    and its sizes may differ, and every arg is one the app accepts."""
    from rayvllm.entrypoints.serve_builder import split_args

    local = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    service = yaml.safe_load((INFRA / "kuberay" / "rayservice.yaml").read_text())
    kube = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert local["http_options"]["port"] == kube["http_options"]["port"]
    (a,), (b,) = local["applications"], kube["applications"]
    assert {k: a[k] for k in ("name", "route_prefix", "import_path")} == {k: b[k] for k in ("name", "route_prefix", "import_path")}
    for app in (a, b):
        split_args(app["args"])  # raises on an unknown argument


def test_one_ray_version_everywhere() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (pin,) = _pinned_ray(" ".join(project["project"]["dependencies"]))
    import ray

    assert ray.__version__ == pin
    service = yaml.safe_load((INFRA / "kuberay" / "rayservice.yaml").read_text())
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == pin
