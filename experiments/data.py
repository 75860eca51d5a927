"""Datasets for the experiments: found locally, or downloaded once, checked and cached.

Each file is looked up, in order, in:

1. the directory `data_dir` passed to the loader (the experiments' `--data-dir`) or, when it
   is None, the directory named by the environment variable `JSA_DATA_DIR`: the file may
   sit in it directly or in its dataset sub-folder (`mnist/`, `tinyshakespeare/`);
2. the per-user cache, `$XDG_CACHE_HOME/jax_scaled_arithmetics/<dataset>/` (by default
   `~/.cache/jax_scaled_arithmetics/<dataset>/`);
3. the dataset's public location: the file is downloaded (standard-library `urllib`, with
   a progress bar), its SHA-256 checked, and it is stored in the cache.

Every file found or downloaded must match its recorded SHA-256, so a loader returns the
genuine data or raises :class:`DataError`, whose message names the URL and the expected
checksum. Nothing is read from outside these places.

Examples:
    >>> from experiments import data
    >>> images, labels = data.mnist("test")  # doctest: +SKIP
    >>> images.shape, images.dtype, labels[:5].tolist()  # doctest: +SKIP
    ((10000, 28, 28), dtype('uint8'), [7, 2, 1, 0, 4])
    >>> text = data.tinyshakespeare()  # doctest: +SKIP
    >>> len(text), text[:14]  # doctest: +SKIP
    (1115394, 'First Citizen:')
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import http.client
import os
import struct
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "DATA_DIR_ENV",
    "MNIST_FILES",
    "MNIST_URL",
    "TINYSHAKESPEARE",
    "TINYSHAKESPEARE_URL",
    "ChecksumError",
    "DataError",
    "RemoteFile",
    "cache_dir",
    "download",
    "fetch",
    "mnist",
    "read_idx",
    "read_mnist",
    "sha256_of",
    "tinyshakespeare",
]

DATA_DIR_ENV = "JSA_DATA_DIR"
"""Environment variable naming a local data directory (used when `data_dir` is None)."""

MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
"""The MNIST mirror torchvision downloads from (byte-identical to the original files)."""

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
"""tiny-shakespeare's canonical location: `data/tinyshakespeare/input.txt` of karpathy/char-rnn."""

_CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """A published file: its name, size and checksums.

    `sha256` and `size` are those of the file's content; for a file that may also be
    stored gzip-compressed (`name + ".gz"`, see `gzip_ok`), the content after decompression.

    Examples:
        >>> RemoteFile("hello.txt", 5, hashlib.sha256(b"hello").hexdigest()).size
        5
    """

    name: str
    size: int
    sha256: str
    md5: str | None = None  # the published MD5, for reference
    gzip_ok: bool = False  # a local `name + ".gz"` is accepted too


# SHA-256s: computed from the genuine files of the project's offline mirror (their MD5s match
# the published ones below), except train-images-idx3-ubyte.gz, which that mirror lacks: its
# SHA-256 is the one TensorFlow Datasets publishes (url_checksums/mnist.txt). MD5s: the ones
# torchvision checks for the same mirror (torchvision.datasets.MNIST.resources).
MNIST_FILES: dict[str, RemoteFile] = {
    f.name: f
    for f in (
        RemoteFile(
            "train-images-idx3-ubyte.gz",
            9_912_422,
            "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        ),
        RemoteFile(
            "train-labels-idx1-ubyte.gz",
            28_881,
            "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "d53e105ee54ea40749a09fcbcd1e9432",
        ),
        RemoteFile(
            "t10k-images-idx3-ubyte.gz",
            1_648_877,
            "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "9fb629c4189551a2d022fa330f9573f3",
        ),
        RemoteFile(
            "t10k-labels-idx1-ubyte.gz",
            4_542,
            "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
            "ec29112dd5afa0611ce80d1b7f02629c",
        ),
    )
}
"""The four MNIST files, by name: size, SHA-256 and MD5 of the `.gz` files."""

# The text's SHA-256 and MD5, computed from the genuine corpus (stored gzipped in the project's
# offline mirror; the SHA-256 of the decompressed text, which is what is downloaded).
TINYSHAKESPEARE = RemoteFile(
    "input.txt",
    1_115_394,
    "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    "6fb458f1232090904fb40fe944165e91",
    gzip_ok=True,
)
"""tiny-shakespeare's `input.txt` (1,115,394 bytes of ASCII text)."""

_MNIST_SPLITS = {"train": "train", "test": "t10k", "t10k": "t10k"}
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DataError(RuntimeError):
    """A data file is not found locally and cannot be downloaded, or it is not genuine."""


class ChecksumError(DataError):
    """A data file (local or downloaded) does not match its recorded size or SHA-256."""


# --- locations -------------------------------------------------------------------------


def cache_dir() -> Path:
    """The per-user data cache: `$XDG_CACHE_HOME/jax_scaled_arithmetics` (`~/.cache/...`).

    Examples:
        >>> cache_dir().name
        'jax_scaled_arithmetics'
    """
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "jax_scaled_arithmetics"


def _local_dir(data_dir: str | os.PathLike[str] | None) -> Path | None:
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env).expanduser() if env else None


# --- checksums -------------------------------------------------------------------------


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    return iter(lambda: f.read(_CHUNK), b"")


def sha256_of(path: str | os.PathLike[str], decompress: bool = False) -> tuple[str, int]:
    """SHA-256 (hex) and size in bytes of a file, or of its gzip-decompressed content.

    Examples:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
        >>> _ = p.write_bytes(b"hello")
        >>> digest, size = sha256_of(p)
        >>> digest[:16], size
        ('2cf24dba5fb0a30e', 5)
    """
    digest, size = hashlib.sha256(), 0
    opener: Callable[..., Any] = gzip.open if decompress else open
    with opener(path, "rb") as f:
        for chunk in _chunks(f):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _check(path: Path, remote: RemoteFile, origin: str) -> None:
    """Raise ChecksumError unless `path` holds `remote`'s content (`origin`: where it is)."""
    try:
        # `name.gz` for a RemoteFile `name`: a compressed copy, checked after decompression.
        actual, size = sha256_of(path, decompress=path.name != remote.name)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise ChecksumError(
            f"{path} (in {origin}) cannot be read ({e}); expected SHA-256 {remote.sha256}."
        ) from e
    if actual != remote.sha256 or size != remote.size:
        raise ChecksumError(
            f"{path} (in {origin}) is not the genuine {remote.name}: expected SHA-256 "
            f"{remote.sha256} ({remote.size} bytes), got {actual} ({size} bytes)."
        )


# --- download --------------------------------------------------------------------------


class _Progress:
    """tqdm's progress bar when tqdm is installed, else a line on stderr every 10%."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self.shown = total, desc, 0, -1
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False)

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        tenth = 10 * self.done // max(self.total, 1)
        if tenth != self.shown:
            self.shown = tenth
            sys.stderr.write(f"\r{self.desc}: {min(10 * tenth, 100)}% of {self.total:,} bytes")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.shown >= 0:
            sys.stderr.write("\n")


def download(
    url: str,
    dest: str | os.PathLike[str],
    sha256: str,
    size: int | None = None,
    progress: bool = True,
    timeout: float = 60.0,
) -> Path:
    """Download `url` to `dest`, checking its SHA-256 (and size), atomically.

    The bytes go to a temporary file beside `dest`, which replaces `dest` only once the
    checksum matches; otherwise it is removed.

    Args:
        url: any URL `urllib` opens (`https://`, `http://`, `file://`).
        dest: where to store the file; its folder is created.
        sha256: the expected SHA-256 of the downloaded bytes (hex).
        size: the expected size in bytes, if known.
        progress: show a progress bar (tqdm if installed).
        timeout: socket timeout in seconds.

    Raises:
        DataError: the download failed (the message names the URL and the checksum).
        ChecksumError: the bytes do not match `sha256` or `size`.

    Examples:
        >>> import pathlib, tempfile
        >>> src = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
        >>> _ = src.write_bytes(b"hello")
        >>> sha = hashlib.sha256(b"hello").hexdigest()
        >>> download(src.as_uri(), src.with_name("b.txt"), sha, progress=False).read_bytes()
        b'hello'
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    digest, received = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    total = size or int(response.headers.get("Content-Length") or 0)
                    bar = _Progress(total, f"Downloading {dest.name}") if progress else None
                    try:
                        for chunk in _chunks(response):
                            out.write(chunk)
                            digest.update(chunk)
                            received += len(chunk)
                            if bar is not None:
                                bar.update(len(chunk))
                    finally:
                        if bar is not None:
                            bar.close()
            except (OSError, ValueError, http.client.HTTPException) as e:
                # URLError and HTTPError are OSErrors; ValueError: a malformed URL.
                if isinstance(e, urllib.error.HTTPError):
                    e.close()  # it holds the response's socket
                reason = getattr(e, "reason", None) or e
                raise DataError(
                    f"The download of {url} failed ({reason}); the file's expected SHA-256 is "
                    f"{sha256}. Download it yourself and pass its folder as --data-dir (or set "
                    f"{DATA_DIR_ENV})."
                ) from e
        actual = digest.hexdigest()
        if actual != sha256 or (size is not None and received != size):
            expected_size = "" if size is None else f" ({size} bytes)"
            raise ChecksumError(
                f"Checksum mismatch for {url}: expected SHA-256 {sha256}{expected_size}, got "
                f"{actual} ({received} bytes). The download was discarded."
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def fetch(
    remote: RemoteFile,
    url: str,
    dataset: str,
    data_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """A checked local copy of `remote`: from the data directory, the cache, or `url`.

    Args:
        remote: the file's name, size and SHA-256.
        url: where to download it from when it is not found locally.
        dataset: the dataset's folder name, in the data directory and in the cache.
        data_dir: the local data directory; None: `$JSA_DATA_DIR`, if set.
        progress: show a progress bar while downloading.

    Returns:
        The path of the file (possibly its `.gz` form, when `remote.gzip_ok`).

    Raises:
        ChecksumError: the file in the data directory, or the downloaded one, is not genuine.
        DataError: the file is nowhere locally and cannot be downloaded.

    Examples:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = d.joinpath("a.txt").write_bytes(b"hello")
        >>> f = RemoteFile("a.txt", 5, hashlib.sha256(b"hello").hexdigest())
        >>> fetch(f, "https://example.invalid/a.txt", "demo", data_dir=d) == d / "a.txt"
        True
    """
    names = [remote.name, remote.name + ".gz"] if remote.gzip_ok else [remote.name]
    local = _local_dir(data_dir)
    if local is not None:
        for folder in (local / dataset, local):
            for name in names:
                candidate = folder / name
                if candidate.is_file():
                    _check(candidate, remote, f"data directory {local}")
                    return candidate
    cached = cache_dir() / dataset / remote.name
    if cached.is_file():
        try:
            _check(cached, remote, "the cache")
            return cached
        except ChecksumError:
            pass  # a damaged cache entry: download it again
    try:
        return download(url, cached, remote.sha256, remote.size, progress=progress)
    except ChecksumError:
        raise
    except DataError as e:
        places = [str(local / dataset), str(local)] if local is not None else []
        places.append(str(cached.parent))
        raise DataError(f"{remote.name} is not in {', '.join(places)}. {e}") from e.__cause__


# --- readers ---------------------------------------------------------------------------


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (the MNIST format; gzip-compressed if its name ends in `.gz`).

    Raises:
        ValueError: the file is not a well-formed IDX file.

    Examples:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x-idx1-ubyte"
        >>> _ = p.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 2, 1]))
        >>> read_idx(p).tolist()
        [7, 2, 1]
    """
    path = Path(path)
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4:
        raise ValueError(f"{path}: not an IDX file ({len(raw)} bytes).")
    zero, type_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or type_code not in _IDX_DTYPES or len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: not an IDX file (magic {raw[:4].hex()}).")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    values = np.frombuffer(raw, dtype=_IDX_DTYPES[type_code], offset=4 + 4 * ndim)
    if values.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {values.size} values for shape {shape}.")
    return values.reshape(shape)


def _split_prefix(split: str) -> str:
    if split not in _MNIST_SPLITS:
        raise ValueError(f"Unknown MNIST split {split!r}; choose 'train' or 'test'.")
    return _MNIST_SPLITS[split]


def _read_pair(images_file: Path, labels_file: Path) -> tuple[np.ndarray, np.ndarray]:
    images, labels = read_idx(images_file), read_idx(labels_file)
    if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{images_file.name} {images.shape} and {labels_file.name} {labels.shape} are "
            "not an MNIST split."
        )
    return images.astype(np.uint8), labels.astype(np.int32)


def read_mnist(directory: str | os.PathLike[str], split: str = "test") -> tuple[Any, Any]:
    """Read an MNIST split's IDX `.gz` files from `directory`, without checksums.

    For subsets of MNIST in the same format (such as the tests' fixture); use
    :func:`mnist` for the genuine dataset.

    Returns:
        `(images, labels)`: uint8 images of shape (N, 28, 28) and int32 labels of shape (N,).

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: `split` is not 'train' or 'test', or the files are not an MNIST split.
    """
    prefix, directory = _split_prefix(split), Path(directory)
    files = [directory / f"{prefix}-{kind}-ubyte.gz" for kind in ("images-idx3", "labels-idx1")]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"MNIST file {file} not found.")
    return _read_pair(*files)


def mnist(
    split: str = "test",
    data_dir: str | os.PathLike[str] | None = None,
    *,
    url: str = MNIST_URL,
    progress: bool = True,
) -> tuple[Any, Any]:
    """The genuine MNIST split `split` ('train': 60,000 images; 'test': 10,000).

    Args:
        split: 'train' or 'test' ('t10k' is accepted for 'test').
        data_dir: a directory holding the IDX `.gz` files (or a `mnist/` folder of them);
            None: `$JSA_DATA_DIR`, then the cache, then a download.
        url: the mirror to download from (the files are appended to it).
        progress: show a progress bar while downloading.

    Returns:
        `(images, labels)`: uint8 images of shape (N, 28, 28) and int32 labels of shape (N,).

    Raises:
        ValueError: `split` is not 'train' or 'test'.
        DataError, ChecksumError: as :func:`fetch`.

    Examples:
        >>> images, labels = mnist("test")  # doctest: +SKIP
        >>> images.shape, labels[:5].tolist()  # doctest: +SKIP
        ((10000, 28, 28), [7, 2, 1, 0, 4])
    """
    prefix = _split_prefix(split)
    paths = []
    for kind in ("images-idx3", "labels-idx1"):
        remote = MNIST_FILES[f"{prefix}-{kind}-ubyte.gz"]
        paths.append(fetch(remote, url + remote.name, "mnist", data_dir, progress))
    return _read_pair(*paths)


def tinyshakespeare(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    url: str = TINYSHAKESPEARE_URL,
    progress: bool = True,
) -> str:
    """The genuine tiny-shakespeare corpus (1,115,394 characters, 65 distinct).

    Args:
        data_dir: a directory holding `input.txt` or `input.txt.gz` (or a
            `tinyshakespeare/` folder of it); None: `$JSA_DATA_DIR`, then the cache, then
            a download.
        url: where to download `input.txt` from.
        progress: show a progress bar while downloading.

    Raises:
        DataError, ChecksumError: as :func:`fetch`.

    Examples:
        >>> text = tinyshakespeare()  # doctest: +SKIP
        >>> text[:14], len(set(text))  # doctest: +SKIP
        ('First Citizen:', 65)
    """
    path = fetch(TINYSHAKESPEARE, url, "tinyshakespeare", data_dir, progress)
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return f.read().decode("utf-8")
