"""YARN for real (rnnlm.hadoop.minicluster): the README's recipe (jobs/package.py, a packed
environment, conf/spark/yarn.properties), spark-submit in client and cluster deploy mode with
the corpus and the output on HDFS, an executor's container killed mid-run, and async training
with the parameter server reached from the containers."""
import getpass
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pyspark
import pytest

from conftest import HARBOUR, ROOT, TINY_CLUSTER, set_options
from test_hdfs import cat, home, metrics, read_ck, rounds_written

pytestmark = [pytest.mark.hadoop, pytest.mark.slow]

SPARK_HOME = os.path.dirname(pyspark.__file__)
YARN_RUN = [*TINY_CLUSTER, "train.eval_every=0",
            "data.valid=", "data.train=hdfs:///data/harbour.txt"]


def fits_the_minicluster():
    """What this 2-core machine's cluster can hold, over conf/spark/yarn.properties' sizes; and
    Spark's own jars read where they are (every 'node' is this machine) instead of uploading
    460 MB to HDFS at each submission. Every Spark process stays on loopback. No Spark UI: on YARN the
    AM's proxy filter is added to its handlers while they start, a race inside Spark (Jetty's
    ConcurrentModificationException in ServletHandler.initialize, which failed one submission in CI)."""
    return {"spark.executor.instances": "2", "spark.executor.cores": "1", "spark.task.cpus": "1",
            "spark.executor.memory": "512m", "spark.driver.memory": "512m", "spark.yarn.am.memory": "512m",
            "spark.yarn.jars": f"local:{SPARK_HOME}/jars/*",
            "spark.yarn.appMasterEnv.SPARK_LOCAL_IP": "127.0.0.1",
            "spark.executorEnv.SPARK_LOCAL_IP": "127.0.0.1", "spark.ui.enabled": "false"}


@pytest.fixture(scope="module")
def shipped():
    """dist/rnnlm.zip and dist/rnnlm-env.tar.gz, built by the README's command where
    conf/spark/yarn.properties expects them (dist/ is a build output, ignored by git)."""
    r = subprocess.run([sys.executable, "jobs/package.py", "--env", "dist/rnnlm-env.tar.gz"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["dist/rnnlm.zip", "dist/rnnlm-env.tar.gz"]


@pytest.fixture(scope="module")
def on_hdfs(webhdfs):
    webhdfs.write("/data/harbour.txt", open(HARBOUR, "rb").read(), overwrite=True)


def submit(hadoop, mode, out, *sets):
    """spark-submit --master yarn (from conf/spark/yarn.properties) in deploy ``mode``; a Popen."""
    conf = {**fits_the_minicluster(), "spark.submit.deployMode": mode}
    if mode == "client":
        conf["spark.pyspark.driver.python"] = sys.executable   # the driver runs here, not in ./env
    env = hadoop.env()
    env.update(SPARK_HOME=SPARK_HOME, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("PYSPARK_GATEWAY_PORT", None)
    args = set_options(*YARN_RUN, *sets)
    cmd = [os.path.join(SPARK_HOME, "bin", "spark-submit"), "--properties-file", "conf/spark/yarn.properties",
           *[a for k, v in conf.items() for a in ("--conf", f"{k}={v}")],
           # in cluster mode the driver runs in a container, where --files land in the working directory
           *(["--files", "conf/demo.toml"] if mode == "cluster" else []), "jobs/train.py",
           "--config", "demo.toml" if mode == "cluster" else "conf/demo.toml", "--out", out,
           "--samples", "0", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p, timeout=400):
    """Wait for a submission; kill it (and so its YARN application's driver) if it overruns."""
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        p.kill()
    assert p.returncode == 0, out[-3000:]
    return out


def rest(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def application(hadoop, app_id):
    return rest(f"{hadoop.endpoints.yarn_web}/ws/v1/cluster/apps/{app_id}")["app"]


def executor_jvms(hadoop, app_id):
    """PIDs of the app's executor JVMs: its running containers, as each NodeManager lists them,
    other than the ApplicationMaster's (container 1); each found by its container id."""
    ids = []
    for node in rest(f"{hadoop.endpoints.yarn_web}/ws/v1/cluster/nodes")["nodes"]["node"]:
        listed = rest(f"http://{node['nodeHTTPAddress']}/ws/v1/node/containers")["containers"] or {}
        for c in listed.get("container", []):
            if c["state"] == "RUNNING" and app_id.split("_", 1)[1] in c["id"] and not c["id"].endswith("_000001"):
                ids.append(c["id"])
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if cmd[0].endswith(b"/java") and any(i.encode() in b" ".join(cmd) for i in ids) \
                and b"org.apache.spark.executor.YarnCoarseGrainedExecutorBackend" in cmd:
            pids.append(int(d))
    return pids


def app_id_of(webhdfs, out):
    return json.loads(cat(webhdfs, f"{out}/run.json"))["application_id"]


@pytest.fixture(scope="module")
def client_run(hadoop, webhdfs, shipped, on_hdfs):
    """8 rounds in client deploy mode: the reference the cluster-mode run is held against."""
    finish(submit(hadoop, "client", "runs/yarn-client", "train.rounds=8"))
    return home("runs/yarn-client")


def test_client_mode_trains_on_hdfs_and_names_the_application(hadoop, webhdfs, client_run):
    info = json.loads(cat(webhdfs, f"{client_run}/run.json"))
    assert info["master"] == "yarn" and re.fullmatch(r"application_\d+_\d{4}", info["application_id"])
    app = application(hadoop, info["application_id"])
    assert (app["state"], app["finalStatus"], app["applicationType"]) == ("FINISHED", "SUCCEEDED", "SPARK")
    assert [m["round"] for m in metrics(webhdfs, client_run)] == list(range(1, 9))
    assert set(webhdfs.list(client_run)) == {"run.json", "metrics.jsonl", "checkpoint"}
    # its containers' logs reach HDFS, where docs/cluster.md's `yarn logs -applicationId` reads them
    deadline = time.time() + 60
    while app["logAggregationStatus"] not in ("SUCCEEDED", "FAILED", "DISABLED") and time.time() < deadline:
        time.sleep(0.5)
        app = application(hadoop, info["application_id"])
    assert app["logAggregationStatus"] == "SUCCEEDED", app
    assert webhdfs.list(f"/tmp/logs/{getpass.getuser()}", status=False), "no aggregated logs"


def test_cluster_mode_survives_a_killed_executor_container(hadoop, webhdfs, shipped, client_run):
    """The driver in YARN's ApplicationMaster; one executor's JVM killed after round 2: the run
    completes with exactly the client-mode run's parameters and losses."""
    out = home("runs/yarn-cluster")
    p = submit(hadoop, "cluster", out, "train.rounds=8")
    killed, at_round = None, None
    deadline = time.time() + 400
    try:
        while p.poll() is None and time.time() < deadline and killed is None:
            done = rounds_written(webhdfs, out)
            pids = executor_jvms(hadoop, app_id_of(webhdfs, out)) if done >= 2 else []
            if pids:
                killed, at_round = pids[0], done
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.1)
    finally:
        log = finish(p)
    assert killed is not None, f"the run ended before an executor could be killed: {log[-3000:]}"
    assert at_round < 8
    info = json.loads(cat(webhdfs, f"{out}/run.json"))
    app = application(hadoop, info["application_id"])
    assert (app["state"], app["finalStatus"]) == ("FINISHED", "SUCCEEDED")
    a, b = read_ck(webhdfs, f"{client_run}/checkpoint"), read_ck(webhdfs, f"{out}/checkpoint")
    assert np.array_equal(a.params, b.params)
    assert [m["train_loss"] for m in metrics(webhdfs, out)] == [m["train_loss"] for m in metrics(webhdfs, client_run)]


def test_async_mode_on_yarn(hadoop, webhdfs, shipped, on_hdfs):
    """The parameter server on the driver, reached by executors in YARN containers."""
    out = home("runs/yarn-async")
    finish(submit(hadoop, "client", out, "train.mode=async", "train.rounds=4"))
    lines = metrics(webhdfs, out)
    pushes = sum(m.get("pushes", 0) for m in lines)
    assert pushes == 2 * 4                       # every window of both workers landed
    assert lines[-1]["windows_lost"] == 0
    assert json.loads(cat(webhdfs, f"{out}/run.json"))["master"] == "yarn"
