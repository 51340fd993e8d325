"""A lineage's seed (:mod:`rnnlm.spark.seeds`): each partition's file first, else its own share from
the driver's server, checked against what the lineage expects; whatever else answers is refused in
one line. No Spark: the server and the tasks' side in this process."""
import dataclasses

import numpy as np
import pytest

from rnnlm.server import wire
from rnnlm.spark import filestore
from rnnlm.spark.seeds import Probe, SeedError, SeedServer


@pytest.fixture
def served():
    held = {0: {"r": np.arange(6, dtype=np.float32).reshape(2, 3)}, 1: {"r": np.full((2, 3), 7, np.float32)}}
    server = SeedServer(held, "127.0.0.1", log=lambda line: None)
    yield server, held
    server.close()


def test_a_partition_fetches_its_own_share_and_the_bytes_are_counted(served):
    server, held = served
    seed = server.seed({}, {})
    pid, tokens, starts, got, carry = seed((1, "tokens", "starts"))
    assert (pid, tokens, starts, carry) == (1, "tokens", "starts", None)
    assert list(got) == ["r"] and got["r"].dtype == np.float32 and np.array_equal(got["r"], held[1]["r"])
    to_executors, from_executors = server.bytes
    assert to_executors > held[1]["r"].nbytes and 0 < from_executors < 1000        # one share, a small request
    assert seed((2, None, None))[3] is None                                          # a partition holding nothing


def test_a_file_on_this_host_is_read_and_nothing_fetched(served, tmp_path, monkeypatch):
    server, held = served
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
    ref = filestore.save("run", 4, 0, {"r": held[0]["r"] + 1})
    seed = server.seed({0: ref}, {})
    assert np.array_equal(seed.held(0)["r"], held[0]["r"] + 1) and server.bytes == (0, 0)
    filestore.remove("run")                                                          # gone: the driver's copy
    assert np.array_equal(seed.held(0)["r"], held[0]["r"]) and server.bytes[0] > 0


def test_a_seed_that_is_not_what_the_lineage_expects_is_refused(served):
    server, held = served
    seed = server.seed({}, {})
    for specs, match in (({0: (("r", "<f4", (3, 2)),)}, r"answered 'seed'.*expected \(\('r', '<f4', \(3, 2\)\),\)"),
                         ({0: (("r", "<f8", (2, 3)),)}, "expected"),
                         ({0: (("s", "<f4", (2, 3)),)}, "expected")):
        with pytest.raises(SeedError, match=match):
            dataclasses.replace(seed, specs=specs).held(0)
    with pytest.raises(SeedError, match="answered 'refused'"):                      # a partition the driver lacks
        dataclasses.replace(seed, specs={5: seed.specs[0]}).held(5)


def test_a_share_is_fetched_whole_and_a_reply_larger_than_it_is_not_read():
    big = SeedServer({0: {"r": np.ones(1 << 19, np.float32)}}, "127.0.0.1", log=lambda line: None)   # 2 MiB
    try:
        seed = big.seed({}, {})
        assert seed.held(0)["r"].sum() == 1 << 19
        seed = dataclasses.replace(seed, specs={0: (("r", "<f4", ((1 << 19) - 1,)),)})
        with pytest.raises(SeedError, match="could not be fetched.*WireError.*body 2097152") as e:
            seed.held(0)            # 4 bytes short of the body: refused unread
        assert "\n" not in str(e.value)
    finally:
        big.close()


def test_a_server_without_the_secret_or_none_at_all_is_one_line():
    held = {0: {"r": np.zeros(3, np.float32)}}
    server = SeedServer(held, "127.0.0.1", log=lambda line: None)
    seed = server.seed({}, {})
    try:
        with pytest.raises(SeedError, match="could not be fetched from the driver at 127.0.0.1:.*WireError"):
            dataclasses.replace(seed, secret=wire.new_secret()).held(0)
    finally:
        server.close()
    with pytest.raises(SeedError, match="could not be fetched from the driver.*(Connection|refused)") as e:
        seed.held(0)
    assert "\n" not in str(e.value)


def test_the_probe_says_why_a_driver_port_cannot_be_reached_and_nothing_when_it_can(served):
    server, _ = served
    host, port = server.server.address
    assert list(Probe(host, port, server.server.secret)(iter([]))) == []
    server.close()                                          # nothing listens there now: refused, as a firewall's REJECT
    (why,) = Probe(host, port, server.server.secret)(iter([]))
    assert why.startswith("ConnectionRefusedError") and "\n" not in why


def test_a_tasks_seed_probe_and_sink_print_without_their_secret(served):
    """A task's function printed (a log line, an error report, pytest -l) showed the lineage's secret."""
    from rnnlm.spark.channel import Sink
    server, _ = served
    secret = server.server.secret
    for task in (server.seed({}, {}), Probe("127.0.0.1", 1, secret), Sink("127.0.0.1", 1, secret, 3, 1 << 10)):
        assert task.secret == secret and repr(secret) not in repr(task) and secret.hex() not in repr(task)


def test_a_probe_is_tried_again_while_the_server_is_busy_rather_than_called_unreachable():
    """A probe closed before the server's welcome (every slot taken by the other partitions' probes) failed at
    once, and the run broadcast every cut's shares for good."""
    import threading
    server = wire.FrameServer(lambda *request: ("pong", {}, {}), wire.new_secret(), "127.0.0.1", 0, 1 << 10,
                              timeout=5.0, log=lambda line: None, max_connections=1).start()
    held = wire.connect(*server.address, server.secret, 1 << 10, 5.0)      # the one slot
    try:
        threading.Timer(0.5, held.close).start()                           # freed half a second later
        assert list(Probe(*server.address, server.secret)(iter([]))) == []
    finally:
        held.close()
        server.close()


def test_a_driver_address_it_cannot_listen_on_is_a_probes_answer_not_a_failed_probe():
    """spark.driver.host naming an address this machine does not hold (a NAT's): the probe raised OSError, read
    as an executor lost during the probe, and was run again at every cut under a misleading warning."""
    import types
    from rnnlm.spark.seeds import unreachable
    data = types.SimpleNamespace(getNumPartitions=lambda: 2)
    why = unreachable(data, "192.0.2.1", log=lambda line: None)          # TEST-NET-1: no interface holds it
    assert why.startswith("the driver cannot listen on 192.0.2.1 (") and "\n" not in why
