"""jobs/minicluster.py as a user runs it: one line once HDFS and YARN are up, a configuration
directory Hadoop's clients read, and nothing left listening after SIGTERM."""
import os
import select
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from rnnlm.spark.hfs import default_fs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def site(conf_dir, name):
    root = ET.parse(os.path.join(conf_dir, name)).getroot()
    return {p.findtext("name"): p.findtext("value") for p in root.iter("property")}


def port_open(hostport):
    host, port = hostport.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.hadoop
@pytest.mark.slow
def test_command_prints_its_endpoints_and_stops_clean_on_sigterm(hadoop, tmp_path):
    # (the session's cluster fixture is asked for so that a machine without Java skips, or fails in CI)
    p = subprocess.Popen([sys.executable, "jobs/minicluster.py", "--dir", str(tmp_path / "mc"),
                          "--datanodes", "1", "--nodemanagers", "1", "--nm-memory-mb", "1024"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 180)
        assert ready, "no line in 180 s"
        line = p.stdout.readline().strip()
        fields = dict(kv.split("=", 1) for kv in line.split(" "))
        assert sorted(fields) == ["HADOOP_CONF_DIR", "fs.defaultFS", "webhdfs", "yarn"], line
        conf = fields["HADOOP_CONF_DIR"]
        assert conf == str(tmp_path / "mc" / "conf")
        assert default_fs(conf) == fields["fs.defaultFS"]
        assert site(conf, "yarn-site.xml")["yarn.resourcemanager.address"] == fields["yarn"]
        assert site(conf, "hdfs-site.xml")["dfs.replication"] == "1"
        endpoints = [fields["fs.defaultFS"].removeprefix("hdfs://"), fields["webhdfs"].removeprefix("http://"),
                     fields["yarn"]]
        assert all(port_open(e) for e in endpoints), endpoints
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert "stopping (SIGTERM)" in err
    time.sleep(0.5)
    assert [e for e in endpoints if port_open(e)] == []


def test_command_without_java_or_maven_says_what_is_missing(tmp_path):
    (tmp_path / "bin").mkdir()
    os.symlink(sys.executable, tmp_path / "bin" / "python")
    r = subprocess.run([str(tmp_path / "bin" / "python"), "jobs/minicluster.py", "--dir", str(tmp_path / "mc")],
                       cwd=ROOT, env={"PATH": str(tmp_path / "bin")}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: the Hadoop minicluster needs Java 17 (java, javac) and Maven (mvn); not on the PATH: "
        "java, javac, mvn"]
    assert not (tmp_path / "mc").exists()
