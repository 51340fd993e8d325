"""Fetching a corpus over HTTP from a real server on loopback that misbehaves in each way a server can."""
import hashlib
import os
import http.server
import threading
import time

import pytest

from rnnlm import download

DATA = bytes(range(256)) * 4            # 1 KiB


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"       # a body without Content-Length ends when the connection closes

    def do_GET(self):
        how = self.path.strip("/")
        if how == "missing":
            self.send_error(404)
            return
        if how == "redirect":                       # to a Location urllib cannot parse (ValueError, not OSError)
            self.send_response(302)
            self.send_header("Location", "http://[nn/x")
            self.end_headers()
            return
        self.send_response(200)
        if how != "endless":
            self.send_header("Content-Length", str(10 ** 12 if how == "announced" else len(DATA)))
        self.end_headers()
        try:
            if how == "endless":                    # streamed beyond the file's size, with no length
                for _ in range(10 ** 4):
                    self.wfile.write(DATA)
            elif how == "trickle":                  # every byte in time for the socket, the whole far too slow
                for i in range(0, len(DATA), 16):
                    self.wfile.write(DATA[i:i + 16])
                    self.wfile.flush()
                    time.sleep(0.02)
            elif how == "short":
                self.wfile.write(DATA[:100])
            elif how in ("ok", "announced"):
                self.wfile.write(DATA)
        except OSError:                             # the client hung up: what it should do
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{s.server_address[1]}"
    s.shutdown()
    s.server_close()


def fetch(monkeypatch, tmp_path, url):
    monkeypatch.setitem(download.CORPORA, "toy", {"toy.txt": (url, hashlib.sha256(DATA).hexdigest(), len(DATA))})
    return download.fetch("toy", str(tmp_path / "data"), log=lambda s: None)


def test_a_corpus_is_fetched_over_http_and_verified(monkeypatch, tmp_path, server):
    assert fetch(monkeypatch, tmp_path, f"{server}/ok") == [str(tmp_path / "data" / "toy.txt")]
    assert (tmp_path / "data" / "toy.txt").read_bytes() == DATA


@pytest.mark.parametrize("how, needle", [
    ("announced", "announces '1000000000000' bytes, expected 1024"),     # refused before a byte of the body
    ("endless", "sent more than the 1024 bytes expected"),               # read no further than 1025 bytes
    ("trickle", "took longer than 0.3 s (after "),
    ("short", "ended after 100 of 1024 bytes"),
    ("missing", "HTTPError: HTTP Error 404"),
    ("redirect", "ValueError: Invalid IPv6 URL"),
])
def test_a_server_cannot_fill_the_disk_hold_the_fetch_or_cut_it_short(monkeypatch, tmp_path, server, how, needle):
    """Every fetch before read the whole response (shutil.copyfileobj) with only a per-read timeout:
    an endless body filled the disk and a trickle held the fetch for ever."""
    # only the trickle is to run out of time: the others get time enough for a loaded machine's server thread
    monkeypatch.setattr(download, "TIMEOUT_S", 0.3 if how == "trickle" else 10.0)
    monkeypatch.setattr(download, "MIN_RATE", 1 << 40)
    t0 = time.monotonic()
    with pytest.raises(download.DownloadError) as e:
        fetch(monkeypatch, tmp_path, f"{server}/{how}")
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert time.monotonic() - t0 < 5
    assert list((tmp_path / "data").iterdir()) == []                    # nothing half-written is left


def test_a_mirror_file_of_another_size_is_refused_before_it_is_copied(monkeypatch, tmp_path):
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / "toy.txt").write_bytes(DATA + b"x")
    monkeypatch.setitem(download.CORPORA, "toy", {"toy.txt": ("https://example.invalid/toy.txt",
                                                              hashlib.sha256(DATA).hexdigest(), len(DATA))})
    with pytest.raises(download.DownloadError, match=f"^toy.txt: 1025 bytes in the mirror {tmp_path}/mirror, "
                                                     "expected 1024$"):
        download.fetch("toy", str(tmp_path / "data"), str(tmp_path / "mirror"), log=lambda s: None)


@pytest.mark.parametrize("text, fraction, train", [
    ("ab\n\ncd\n\nefgh", 0.5, "ab\n\n"),             # the last paragraph break before the point, kept in train
    ("ab\n\ncd\n\nefgh", 0.75, "ab\n\ncd\n\n"),
    ("abcdefghij", 0.3, "abc"),                      # no break before it: cut at the point
    ("\n\nabcdef", 0.5, "\n\n"),                     # a break at the very start
])
def test_a_corpus_is_split_at_the_paragraph_break_before_its_fraction(tmp_path, text, fraction, train):
    src = tmp_path / "corpus.txt"
    src.write_text(text, encoding="utf-8")
    paths = download.split_train_valid(str(src), fraction)
    assert paths == [str(tmp_path / "corpus.train.txt"), str(tmp_path / "corpus.valid.txt")]
    assert (tmp_path / "corpus.train.txt").read_text(encoding="utf-8") == train
    assert (tmp_path / "corpus.valid.txt").read_text(encoding="utf-8") == text[len(train):]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.train.txt", "corpus.txt", "corpus.valid.txt"]


def test_a_file_present_with_its_checksum_is_kept_and_a_fetched_one_readable_by_all(monkeypatch, tmp_path, server):
    """A second fetch finds the file and does not fetch it again; the file takes the umask's mode, not
    mkstemp's 0600."""
    mask = os.umask(0o022)
    try:
        assert fetch(monkeypatch, tmp_path, f"{server}/ok") == [str(tmp_path / "data" / "toy.txt")]
        said = []
        monkeypatch.setattr(download, "_download", lambda *a: pytest.fail("fetched again"))
        assert download.fetch("toy", str(tmp_path / "data"), log=said.append) == [str(tmp_path / "data" / "toy.txt")]
    finally:
        os.umask(mask)
    assert said == ["toy.txt: present, checksum ok"]
    assert os.stat(tmp_path / "data" / "toy.txt").st_mode & 0o777 == 0o644


def test_a_fifo_or_a_link_to_an_endless_file_under_the_final_name_is_replaced_not_read(monkeypatch, tmp_path, server):
    """The check of a file already present read a FIFO there (blocked for ever) or a link to /dev/zero."""
    (tmp_path / "data").mkdir()
    os.mkfifo(tmp_path / "data" / "toy.txt")
    got = []                       # in a thread: a fetch that reads the FIFO blocks, and the test fails, not hangs
    t = threading.Thread(target=lambda: got.append(fetch(monkeypatch, tmp_path, f"{server}/ok")), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        with open(tmp_path / "data" / "toy.txt", "wb"):     # the reader's writer: it unblocks and ends
            pass
        pytest.fail("the fetch read the FIFO under the final name")
    assert got == [[str(tmp_path / "data" / "toy.txt")]]
    assert (tmp_path / "data" / "toy.txt").read_bytes() == DATA
    os.remove(tmp_path / "data" / "toy.txt")
    os.symlink("/dev/zero", tmp_path / "data" / "toy.txt")
    assert fetch(monkeypatch, tmp_path, f"{server}/ok") == [str(tmp_path / "data" / "toy.txt")]
    assert (tmp_path / "data" / "toy.txt").read_bytes() == DATA and not os.path.islink(tmp_path / "data" / "toy.txt")


def test_a_slow_server_within_the_time_its_size_earns_is_waited_for(monkeypatch, tmp_path, server):
    """The allowance is TIMEOUT_S plus a second per MIN_RATE bytes: 0.3 s + 1024 / 256 s here, and the
    trickle takes ~1.3 s (longer than TIMEOUT_S alone)."""
    monkeypatch.setattr(download, "TIMEOUT_S", 0.3)
    monkeypatch.setattr(download, "MIN_RATE", 256)
    assert fetch(monkeypatch, tmp_path, f"{server}/trickle") == [str(tmp_path / "data" / "toy.txt")]
    assert (tmp_path / "data" / "toy.txt").read_bytes() == DATA
