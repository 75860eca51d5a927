"""experiments/data.py: local lookup, cache and checked downloads, without the network.

Downloads come from a local HTTP server on 127.0.0.1 (or `file://` URLs); the cache is
redirected to a temporary folder with `XDG_CACHE_HOME`.
"""

from __future__ import annotations

import doctest
import gzip
import hashlib
import http.server
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from experiments import data

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "mnist-t10k-first-2000"
TEXT = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"


def remote_for(name: str, content: bytes, gzip_ok: bool = False) -> data.RemoteFile:
    return data.RemoteFile(name, len(content), hashlib.sha256(content).hexdigest(), None, gzip_ok)


class Server:
    """A local HTTP server for `files` (name -> bytes); counts the requests per name."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files, self.requests = files, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                name = self.path.lstrip("/")
                server.requests.append(name)
                if name not in server.files:
                    self.send_error(404)
                    return
                body = server.files[name]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def serve() -> Iterator:
    servers: list[Server] = []

    def start(files: dict[str, bytes]) -> Server:
        servers.append(Server(files))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """An empty per-user cache, and no data directory from the environment."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)


@pytest.fixture
def fixture_as_genuine(monkeypatch):
    """Record the fixture's checksums as the t10k files', so `mnist` accepts it."""
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        monkeypatch.setitem(data.MNIST_FILES, name, remote_for(name, (FIXTURE / name).read_bytes()))


def test_cache_dir_honours_xdg_cache_home(tmp_path, monkeypatch):
    assert data.cache_dir() == tmp_path / "cache" / "jax_scaled_arithmetics"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.cache_dir() == tmp_path / "home" / ".cache" / "jax_scaled_arithmetics"


def test_download_then_cache_hit(serve, tmp_path):
    server = serve({"a.txt": TEXT})
    remote = remote_for("a.txt", TEXT)
    path = data.fetch(remote, server.url + "a.txt", "demo", progress=False)
    assert path == tmp_path / "cache" / "jax_scaled_arithmetics" / "demo" / "a.txt"
    assert path.read_bytes() == TEXT
    assert data.fetch(remote, server.url + "a.txt", "demo", progress=False) == path
    assert server.requests == ["a.txt"]  # the second call read the cache
    assert [p.name for p in path.parent.iterdir()] == ["a.txt"]  # no temporary file left


def test_mnist_downloads_checks_and_caches(serve, fixture_as_genuine):
    names = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
    server = serve({name: (FIXTURE / name).read_bytes() for name in names})
    images, labels = data.mnist("test", url=server.url, progress=False)
    assert images.shape == (2000, 28, 28) and images.dtype == np.uint8
    assert labels.dtype == np.int32 and labels[:5].tolist() == [7, 2, 1, 0, 4]
    images2, labels2 = data.mnist("t10k", url=server.url, progress=False)
    np.testing.assert_array_equal(images2, images)
    np.testing.assert_array_equal(labels2, labels)
    assert sorted(server.requests) == ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]


def test_download_checksum_mismatch_names_url_and_checksum(serve, tmp_path):
    server = serve({"t10k-images-idx3-ubyte.gz": b"not mnist", "t10k-labels-idx1-ubyte.gz": b""})
    expected = data.MNIST_FILES["t10k-images-idx3-ubyte.gz"].sha256
    url = server.url + "t10k-images-idx3-ubyte.gz"
    with pytest.raises(data.ChecksumError) as info:
        data.mnist("test", tmp_path / "empty", url=server.url, progress=False)
    message = str(info.value)
    assert message.startswith(f"Checksum mismatch for {url}: expected SHA-256 {expected}")
    assert "(1648877 bytes)" in message and "(9 bytes)" in message
    cache = tmp_path / "cache" / "jax_scaled_arithmetics" / "mnist"
    assert list(cache.iterdir()) == []  # the bad download was discarded


def test_missing_data_and_failed_download(serve, tmp_path):
    server = serve({})  # every request: 404
    expected = data.MNIST_FILES["t10k-images-idx3-ubyte.gz"].sha256
    local = tmp_path / "nothing here"
    with pytest.raises(data.DataError) as info:
        data.mnist("test", local, url=server.url, progress=False)
    assert type(info.value) is data.DataError
    message = str(info.value)
    url = server.url + "t10k-images-idx3-ubyte.gz"
    assert message.startswith(f"t10k-images-idx3-ubyte.gz is not in {local / 'mnist'}, {local}, ")
    assert f"The download of {url} failed (Not Found)" in message
    assert f"expected SHA-256 is {expected}" in message
    assert "--data-dir" in message and data.DATA_DIR_ENV in message


def test_failed_download_of_unreachable_url(tmp_path):
    missing = (tmp_path / "no-such-file.txt").as_uri()
    with pytest.raises(data.DataError, match=re.escape(f"The download of {missing} failed")):
        data.fetch(remote_for("a.txt", TEXT), missing, "demo", progress=False)
    with pytest.raises(data.DataError, match="The download of not-a-url failed"):
        data.download("not-a-url", tmp_path / "a.txt", "0" * 64, progress=False)


def test_lookup_order_argument_then_environment_then_cache(tmp_path, monkeypatch):
    remote = remote_for("a.txt", TEXT)
    nowhere = (tmp_path / "absent").as_uri()  # any download would fail
    env_dir, arg_dir = tmp_path / "env", tmp_path / "arg"
    (env_dir / "demo").mkdir(parents=True)
    (env_dir / "demo" / "a.txt").write_bytes(TEXT)  # in the dataset's sub-folder
    arg_dir.mkdir()
    (arg_dir / "a.txt").write_bytes(TEXT)  # directly in the folder
    monkeypatch.setenv(data.DATA_DIR_ENV, str(env_dir))
    assert data.fetch(remote, nowhere, "demo") == env_dir / "demo" / "a.txt"
    assert data.fetch(remote, nowhere, "demo", data_dir=arg_dir) == arg_dir / "a.txt"
    monkeypatch.delenv(data.DATA_DIR_ENV)
    cached = data.cache_dir() / "demo" / "a.txt"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(TEXT)
    assert data.fetch(remote, nowhere, "demo") == cached
    # A data directory without the file falls through to the cache.
    assert data.fetch(remote, nowhere, "demo", data_dir=tmp_path / "empty") == cached


def test_damaged_local_file_is_an_error(tmp_path):
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"corrupt")
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(b"corrupt")
    expected = data.MNIST_FILES["t10k-images-idx3-ubyte.gz"].sha256
    pattern = (
        f"{re.escape(str(tmp_path / 't10k-images-idx3-ubyte.gz'))} \\(in data directory .*\\) is "
        f"not the genuine t10k-images-idx3-ubyte.gz: expected SHA-256 {expected} \\(1648877 bytes"
    )
    with pytest.raises(data.ChecksumError, match=pattern):
        data.mnist("test", tmp_path, progress=False)


def test_damaged_cache_entry_is_downloaded_again(serve):
    server = serve({"a.txt": TEXT})
    cached = data.cache_dir() / "demo" / "a.txt"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"truncated")
    path = data.fetch(remote_for("a.txt", TEXT), server.url + "a.txt", "demo", progress=False)
    assert path == cached and cached.read_bytes() == TEXT
    assert server.requests == ["a.txt"]


@pytest.mark.parametrize("compressed", [False, True])
def test_tinyshakespeare_text_or_gzipped_text(tmp_path, monkeypatch, compressed):
    monkeypatch.setattr(data, "TINYSHAKESPEARE", remote_for("input.txt", TEXT, gzip_ok=True))
    folder = tmp_path / "tinyshakespeare"
    folder.mkdir()
    if compressed:
        (folder / "input.txt.gz").write_bytes(gzip.compress(TEXT))
    else:
        (folder / "input.txt").write_bytes(TEXT)
    text = data.tinyshakespeare(tmp_path, url=(tmp_path / "absent").as_uri())
    assert text == TEXT.decode() and text.startswith("First Citizen:")


def test_tinyshakespeare_gzipped_copy_is_checked_after_decompression(tmp_path):
    (tmp_path / "input.txt.gz").write_bytes(gzip.compress(b"not shakespeare"))
    with pytest.raises(data.ChecksumError, match=f"expected SHA-256 {data.TINYSHAKESPEARE.sha256}"):
        data.tinyshakespeare(tmp_path)
    (tmp_path / "input.txt.gz").write_bytes(b"not gzip")
    with pytest.raises(data.ChecksumError, match="cannot be read"):
        data.tinyshakespeare(tmp_path)


def test_tinyshakespeare_download(serve, monkeypatch):
    monkeypatch.setattr(data, "TINYSHAKESPEARE", remote_for("input.txt", TEXT, gzip_ok=True))
    server = serve({"input.txt": TEXT})
    assert data.tinyshakespeare(url=server.url + "input.txt", progress=False) == TEXT.decode()
    assert (data.cache_dir() / "tinyshakespeare" / "input.txt").read_bytes() == TEXT


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_download_progress(serve, tmp_path, monkeypatch, capsys, with_tqdm):
    content = bytes(range(256)) * 1000  # several chunks
    if not with_tqdm:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` raises ImportError
    server = serve({"big.bin": content})
    sha = hashlib.sha256(content).hexdigest()
    data.download(server.url + "big.bin", tmp_path / "big.bin", sha, len(content))
    assert (tmp_path / "big.bin").read_bytes() == content
    err = capsys.readouterr().err
    assert "big.bin" in err
    if not with_tqdm:
        assert "100% of 256,000 bytes" in err


def test_recorded_checksums():
    hex64 = re.compile(r"[0-9a-f]{64}")
    for name, remote in {**data.MNIST_FILES, "input.txt": data.TINYSHAKESPEARE}.items():
        assert remote.name == name and hex64.fullmatch(remote.sha256) and remote.size > 0
        assert remote.md5 is not None and re.fullmatch(r"[0-9a-f]{32}", remote.md5)
    assert data.MNIST_FILES["t10k-images-idx3-ubyte.gz"].md5 == "9fb629c4189551a2d022fa330f9573f3"
    assert data.TINYSHAKESPEARE.size == 1_115_394


def test_read_idx_and_read_mnist_errors(tmp_path):
    bad = tmp_path / "bad-idx1-ubyte"
    bad.write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x03")
    with pytest.raises(ValueError, match=r"not an IDX file \(magic 01020801\)"):
        data.read_idx(bad)
    short = tmp_path / "short-idx1-ubyte"
    short.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))
    with pytest.raises(ValueError, match=r"2 values for shape \(5,\)"):
        data.read_idx(short)
    with pytest.raises(FileNotFoundError, match="MNIST file .*t10k-images-idx3-ubyte.gz not found"):
        data.read_mnist(tmp_path)
    with pytest.raises(ValueError, match="Unknown MNIST split 'valid'; choose 'train' or 'test'"):
        data.mnist("valid")


def test_doctests():
    result = doctest.testmod(data, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 5 and result.failed == 0
