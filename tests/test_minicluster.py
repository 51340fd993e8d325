"""jobs/minicluster.py as a user runs it: one line once HDFS and YARN are up, a configuration
directory Hadoop's clients read, and nothing left listening after SIGTERM."""
import os
import select
import signal
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from rnnlm.spark.hfs import default_fs

from conftest import ROOT


def site(conf_dir, name):
    root = ET.parse(os.path.join(conf_dir, name)).getroot()
    return {p.findtext("name"): p.findtext("value") for p in root.iter("property")}


def listening(pid):
    """``{(address hex, port)}`` of every socket process ``pid`` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:             # closed while we looked
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:          # state LISTEN
                addr, port = f[1].split(":")
                found.add((addr, int(port, 16)))
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def cmdline_has(pid, text):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"MiniCluster" in cmd and text.encode() in cmd


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
        assert line.startswith("HADOOP_CONF_DIR="), p.stderr.read() if p.poll() is not None else line
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
        jvm = [int(x) for x in os.listdir("/proc") if x.isdigit() and cmdline_has(int(x), str(tmp_path / "mc"))]
        assert len(jvm) == 1
        ports = listening(jvm[0])
        # NameNode (RPC, HTTP), DataNode (data, IPC, HTTP), ResourceManager (5), NodeManager (3 at least)
        assert len(ports) >= 12 and {a for a, _ in ports} <= LOOPBACK, ports
        assert {int(e.rsplit(":", 1)[1]) for e in endpoints} <= {port for _, port in ports}
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=120)
        finally:
            p.kill()
    assert p.returncode == 0, err
    assert "stopping (SIGTERM)" in err
    assert not os.path.exists(f"/proc/{jvm[0]}") or not cmdline_has(jvm[0], str(tmp_path / "mc"))
    open_now = {port for _, port in ports if port_open(f"localhost:{port}")}
    assert open_now == set()


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


def test_a_dir_the_ready_line_cannot_carry_and_a_cache_that_cannot_be_written_are_one_line(tmp_path, monkeypatch):
    """A quote in --dir made the launcher's ready line invalid JSON (a backslash, silently another path), and an
    unwritable cache an OSError: tracebacks, after the JVM's start for the first."""
    from rnnlm.hadoop import minicluster
    from rnnlm.hadoop.minicluster import MiniCluster, MiniClusterError
    monkeypatch.setattr(minicluster, "missing_tools", lambda: None)
    for name in ('a"b', "a\\b", "a\nb"):
        with pytest.raises(MiniClusterError, match="a quote, a backslash or a control character"):
            MiniCluster(str(tmp_path / name)).start()
    (tmp_path / "file").write_text("x")
    with pytest.raises(MiniClusterError, match=r"^cannot build in .*/file/cache: Not a directory$"):
        minicluster.build(str(tmp_path / "file" / "cache"))
