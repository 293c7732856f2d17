"""`stillcut serve --replicas`: its flags become the cluster's settings, without them a server
never imports Ray, and without Ray installed they say which extra to install."""

import subprocess
import sys

import pytest

from stillcut.service import cli
from stillcut.service.api import DEMO_MODEL_NAME
from stillcut.service.cluster import launch
from stillcut.service.cluster.launch import ClusterConfig

WITHOUT_RAY = """
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)  # not installed

sys.meta_path.insert(0, Blocker())
from stillcut.service import cli, server
served = []
server.serve = lambda llm, config, **where: served.append(where)
assert cli.main(["serve", "--model", sys.argv[1], "--port", "9999"]) == 0
assert served == [{"host": "127.0.0.1", "port": 9999}], served
assert not [name for name in sys.modules if name.split(".")[0] == "ray"]
print("served without ray")
assert cli.main(["serve", "--model", sys.argv[1], "--replicas", "2"]) == 2
"""


def test_serve_without_replicas_never_imports_ray(tiny_checkpoint):
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, str(tiny_checkpoint)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "served without ray" in result.stdout
    assert "--replicas needs Ray Serve" in result.stderr
    assert "pip install 'stillcut[cluster]'" in result.stderr


def _served(monkeypatch, argv: list[str]) -> dict:
    served = {}
    monkeypatch.setattr(
        launch,
        "serve_cluster",
        lambda spec, cluster, **where: served.update(where, spec=spec, cluster=cluster),
    )
    assert cli.main(argv) == 0
    return served


def test_serve_with_replicas_turns_flags_into_the_cluster(tiny_checkpoint, monkeypatch):
    argv = [
        *("serve", "--model", str(tiny_checkpoint), "--replicas", "3", "--port", "9000"),
        *("--num-cpus-per-replica", "2", "--num-gpus-per-replica", "0.5"),
        *("--affinity-margin", "6", "--max-queue", "5", "--max-model-len", "1024"),
        *("--no-evs", "--log-level", "warning", "--ray-address", "auto"),
        *("--kv-cache-dtype", "bfloat16"),
    ]
    served = _served(monkeypatch, argv)
    assert (served["host"], served["port"]) == ("127.0.0.1", 9000)
    assert served["cluster"] == ClusterConfig(
        num_replicas=3,
        ray_address="auto",
        num_cpus_per_replica=2.0,
        num_gpus_per_replica=0.5,
        affinity_margin=6,
    )
    spec = served["spec"]
    assert (spec.model, spec.name, spec.evs) == (str(tiny_checkpoint), None, None)
    assert (spec.num_cpus, spec.log_level, spec.server.max_queue) == (2.0, "warning", 5)
    assert spec.engine_config.scheduler.max_model_len == 1024
    assert spec.engine_config.kv_cache_dtype == "bfloat16"
    assert spec.engine_config.device == "cuda"  # a replica with a GPU runs on it


def test_a_clusters_nodes_build_the_demo_checkpoint_themselves(monkeypatch):
    served = _served(monkeypatch, ["serve", "--replicas", "2", "--ray-address", "auto"])
    assert (served["spec"].model, served["spec"].name) == (None, DEMO_MODEL_NAME)
    assert served["spec"].engine_config.device == "cpu"


def test_cluster_flags_need_replicas(capsys):
    assert cli.main(["serve", "--ray-address", "auto"]) == 2
    assert "--ray-address needs --replicas N" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_replicas": 0}, "num_replicas=0 must be an integer >= 1"),
        ({"num_cpus_per_replica": 0.0}, "num_cpus_per_replica=0.0 must be a finite number > 0"),
        ({"num_gpus_per_replica": -1.0}, "num_gpus_per_replica=-1.0 must be a finite"),
        ({"affinity_margin": -1}, "affinity_margin=-1 must be an integer >= 0"),
        ({"ray_address": "auto", "num_cpus": 2}, "num_cpus sizes a local Ray instance"),
    ],
)
def test_cluster_config_names_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**{"num_replicas": 2, **fields})
