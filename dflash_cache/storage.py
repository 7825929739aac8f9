"""Byte-level access to a cache location: a local directory or any fsspec URL.

Arrays are written through zarr (``zarr_store(prefix)`` gives a store rooted at a part, so zarr never
touches the cache's root metadata); everything else -- commit records, the head, JSON metadata, and
the reader's direct chunk reads -- goes through these few methods. Keys are ``/``-separated paths
relative to the cache root.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import threading
from pathlib import Path
from typing import Any

import fsspec
import fsspec.config
from fsspec.implementations.local import LocalFileSystem

from .errors import CacheError
from .runtime.switches import env_switch


def storage_error(err: OSError, url: str, what: str) -> CacheError:
    """``err`` (raised while ``what``, e.g. "writing part buckets/0/u0000001") as a CacheError that
    names the path and says what to do."""
    path = err.filename or url
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheError(f"no space left on the device (or over quota) while {what} ({path}): free space, or "
                          "choose another --out, and rerun the same command; committed parts are kept and the run "
                          "resumes where it stopped")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CacheError(f"permission denied while {what} ({path}: {err.strerror}): make {url} writable for this "
                          "user, or choose another --out")
    if err.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return CacheError(f"a file stands where a directory is needed (or the reverse) while {what} ({path}: "
                          f"{err.strerror}): point --out at a new path or an existing cache")
    return CacheError(f"storage error while {what} ({path}): {err.strerror or err}; rerun the same command to "
                      "resume (committed parts are kept)")


def fsync_enabled() -> bool:
    """``DFLASH_CACHE_FSYNC=0`` skips fsync (tests, scratch caches): commits stay atomic, not durable."""
    return env_switch("DFLASH_CACHE_FSYNC", "1") != "0"


def is_local_url(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


class Storage:
    """Interface; see :class:`LocalStorage` and :class:`FsspecStorage`."""

    url: str
    is_local: bool = False
    # what is read once per storage object on remote stores, where every read is a request: verified small
    # arrays (sample_ids, offsets) by (key, crc32c from the commit record) and commit records by (key, 0)
    # (created once, never rewritten). None: nothing kept (local files are read again)
    small_arrays: dict[tuple[str, int], Any] | None = None
    # read_into fills the caller's buffer without a new bytes object per read (read-ahead then reads into
    # reused buffers); False where the client returns a new object per response anyway (s3fs, gcsfs ...)
    reads_into: bool = False

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key``."""
        raise NotImplementedError

    def get_suffix(self, key: str, n: int) -> bytes:
        """The last ``n`` bytes of ``key`` (fewer when the object is shorter)."""
        raise NotImplementedError

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        """Read ``len(buf)`` bytes of ``key`` from ``start`` into ``buf`` (one request); returns the count read,
        fewer only at the end of the object."""
        data = self.get_range(key, start, start + len(buf))
        buf[:len(data)] = data
        return len(data)

    def open_range(self, key: str, start: int, end: int) -> RangeReader:
        """Reads within bytes ``[start, end)`` of ``key`` (raises FileNotFoundError when it is missing).
        Remote stores fetch the range once; local files are read in place, piece by piece."""
        return BytesRangeReader(self.get_range(key, start, end), start)

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def put(self, key: str, data: bytes, durable: bool = False) -> None:
        """Write an object whole; readers never see it half-written."""
        raise NotImplementedError

    def create_exclusive(self, key: str, data: bytes, durable: bool = False) -> bool:
        """Create ``key`` with ``data`` unless it exists (then return False). Of several processes
        creating one key, exactly one succeeds, and readers never see it half-written (see the
        subclasses for where that holds)."""
        raise NotImplementedError

    def list_dir(self, prefix: str) -> list[str]:
        """Names of the direct children of ``prefix`` (files and directories)."""
        raise NotImplementedError

    def list_files(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` (recursive) with its size in bytes."""
        raise NotImplementedError

    def remove(self, key: str) -> None:
        raise NotImplementedError

    def remove_tree(self, prefix: str) -> None:
        raise NotImplementedError

    def remove_entry(self, key: str) -> None:
        """Remove ``key``, a file or a directory tree (nothing if it is missing)."""
        raise NotImplementedError

    def remove_empty_dir(self, prefix: str) -> None:
        """Remove the directory ``prefix`` if it is empty (object stores have no directories)."""

    def root_is_file(self) -> bool:
        """The location is an existing file (not a directory, not missing)."""
        raise NotImplementedError

    def sync_tree(self, prefix: str) -> None:
        """Make everything under ``prefix`` durable (fsync on a local filesystem)."""

    def root_exists(self) -> bool:
        raise NotImplementedError

    def zarr_store(self, prefix: str) -> Any:
        raise NotImplementedError

    def preflight(self) -> None:
        """Check that the store can be reached (one clear error, not a traceback, when it cannot)."""

    def check_exclusive_create(self) -> None:
        """Check that :meth:`create_exclusive` really refuses a second create (leases and commit records
        rest on it); CacheError when it does not."""



class RangeReader:
    """Positional reads of one object; use as a context manager (closes the file)."""

    def read_into(self, start: int, bufs: list[memoryview]) -> int:
        """Fill ``bufs`` in order from byte ``start`` of the object; returns the bytes read."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BytesRangeReader(RangeReader):
    def __init__(self, data: bytes, offset: int):
        self.data, self.offset = memoryview(data), offset


    def read_into(self, start: int, bufs: list[memoryview]) -> int:
        pos = start - self.offset
        got = 0
        for buf in bufs:
            piece = self.data[max(pos, 0):max(pos, 0) + len(buf)]
            buf[:len(piece)] = piece
            got += len(piece)
            pos += len(buf)
            if len(piece) < len(buf):
                break
        return got


class FileRangeReader(RangeReader):
    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)

    def read_into(self, start: int, bufs: list[memoryview]) -> int:
        want = sum(len(b) for b in bufs)
        got = os.preadv(self.fd, bufs, start)
        if got >= want:
            return got
        total = pos = 0  # a short read: finish buffer by buffer (stops at the end of the file)
        for buf in bufs:
            have = min(max(got - pos, 0), len(buf))
            while have < len(buf):
                more = os.preadv(self.fd, [buf[have:]], start + pos + have)
                if more <= 0:
                    return total + have
                have += more
            total, pos = total + have, pos + len(buf)
        return total

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _fill(read: Any, buf: memoryview) -> int:
    """``read(view)`` (a readinto) until ``buf`` is full or the object ends; returns the bytes read."""
    got = 0
    while got < len(buf):
        n = read(buf[got:])
        if not n:
            break
        got += n
    return got


class LocalStorage(Storage):
    is_local = True
    reads_into = True

    def __init__(self, url: str):
        self.url = url
        self.root = Path(url[len("file://"):] if url.startswith("file://") else url)

    def _p(self, key: str) -> Path:
        return self.root / key if key else self.root

    def get(self, key: str) -> bytes:
        with open(self._p(key), "rb") as f:
            return f.read()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with open(self._p(key), "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    def get_suffix(self, key: str, n: int) -> bytes:
        with open(self._p(key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            return os.pread(f.fileno(), min(n, size), max(0, size - n))

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        fd = os.open(self._p(key), os.O_RDONLY)
        try:
            at = [start]

            def read(view: memoryview) -> int:
                n = os.preadv(fd, [view], at[0])
                at[0] += n
                return n

            return _fill(read, buf)
        finally:
            os.close(fd)

    def open_range(self, key: str, start: int, end: int) -> RangeReader:
        return FileRangeReader(self._p(key))

    def exists(self, key: str) -> bool:
        return self._p(key).exists()

    def _write_temp(self, path: Path, data: bytes, durable: bool) -> Path:
        """``data`` in a new hidden file beside ``path``, created with mode 0666 less the umask (so a
        cache on shared storage is as readable as any other file its user creates)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        return self._new_temp(path, data, durable)

    def _new_temp(self, path: Path, data: bytes, durable: bool) -> Path:
        """The temporary file of :meth:`_write_temp` in ``path``'s directory, which must exist
        (FileNotFoundError when it was removed since it was made)."""
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if durable and fsync_enabled():
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put(self, key: str, data: bytes, durable: bool = False) -> None:
        path = self._p(key)
        tmp = self._write_temp(path, data, durable)
        try:
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable and fsync_enabled():
            fsync_dir(path.parent)

    def create_exclusive(self, key: str, data: bytes, durable: bool = False) -> bool:
        """A hard link of a complete temporary file: atomic, and it fails when ``key`` exists (also on
        NFS). Filesystems without hard links fall back to ``O_EXCL`` (a reader may then briefly see
        the file empty)."""
        path = self._p(key)
        for _ in range(5):  # the directory can vanish under us (an empty part directory released): recreate it
            try:  # (a lock's caller counts a directory that keeps vanishing as a lost race: locks.take_generation)
                tmp = self._write_temp(path, data, durable)
            except (FileNotFoundError, FileExistsError):  # (mkdir raced a removal of the directory)
                continue
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            except FileNotFoundError:
                continue
            except OSError as err:
                if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                return self._create_excl_open(path, data, durable)
            finally:
                tmp.unlink(missing_ok=True)
            if durable and fsync_enabled():
                fsync_dir(path.parent)
            return True
        raise FileNotFoundError(errno.ENOENT, "directory keeps disappearing", str(path.parent))

    def _create_excl_open(self, path: Path, data: bytes, durable: bool) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable and fsync_enabled():
                f.flush()
                os.fsync(f.fileno())
        return True

    def list_dir(self, prefix: str) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self._p(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_files(self, prefix: str) -> dict[str, int]:
        base = self._p(prefix)
        out: dict[str, int] = {}
        for dirpath, _, files in os.walk(base):
            for name in files:
                full = Path(dirpath) / name
                out[full.relative_to(self.root).as_posix()] = full.stat().st_size
        return out

    def remove(self, key: str) -> None:
        self._p(key).unlink(missing_ok=True)

    def remove_tree(self, prefix: str) -> None:
        shutil.rmtree(self._p(prefix), ignore_errors=True)

    def remove_entry(self, key: str) -> None:
        p = self._p(key)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)

    def remove_empty_dir(self, prefix: str) -> None:
        with contextlib.suppress(OSError):  # not empty (someone writes there again), or already gone
            self._p(prefix).rmdir()

    def root_is_file(self) -> bool:
        return self.root.exists() and not self.root.is_dir()

    def sync_tree(self, prefix: str) -> None:
        if not fsync_enabled():
            return
        base = self._p(prefix)
        for dirpath, _, files in os.walk(base):
            for name in files:
                fd = os.open(Path(dirpath) / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(Path(dirpath))
        # the directory entries that reach it, up to the root (a part's generation directory sits in the
        # part's directory, which sits in its bucket's)
        parent = base.parent
        while True:
            fsync_dir(parent)
            if parent == self.root or self.root not in parent.parents:
                break
            parent = parent.parent

    def root_exists(self) -> bool:
        return self.root.exists()

    def zarr_store(self, prefix: str) -> Any:
        from zarr.storage import LocalStore

        return LocalStore(self._p(prefix))


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries durable (after creating or renaming something in it). A filesystem that
    does not support fsync on a directory (EINVAL, ENOTSUP, EBADF: some network filesystems) is skipped;
    any other error (EIO) is raised. The one policy for caches, checkpoints and answer logs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


_CREATE_LOCK = threading.Lock()  # FsspecStorage.create_exclusive: one check-and-write at a time per process

# Defaults for S3-compatible stores (docs/cache.md, "Object storage"); FSSPEC_S3='{"config_kwargs": {...}}'
# (or any fsspec config) overrides them key by key.
S3_DEFAULTS: dict[str, Any] = {"config_kwargs": {"max_pool_connections": 64, "connect_timeout": 10, "read_timeout": 120,
                                                 "retries": {"max_attempts": 10, "mode": "adaptive"}}}
_PACKAGES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", None), "gcs": ("gcsfs", None),
             "az": ("adlfs", None), "abfs": ("adlfs", None)}
_BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _storage_options(protocol: str) -> dict[str, Any]:
    if protocol not in ("s3", "s3a"):
        return {}
    user = fsspec.config.conf.get("s3", {})
    return _merge(S3_DEFAULTS, user)


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint"


class FsspecStorage(Storage):
    """Any fsspec filesystem (``memory://``, ``s3://``, ``gs://`` ...). Object puts are atomic."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        proto = _protocol(self.url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **_storage_options(proto))
        except ImportError:
            package, extra = _PACKAGES.get(proto, (f"the fsspec implementation of {proto}://", None))
            how = f"pip install 'dflash-pipeline[{extra}]'" if extra else f"pip install {package}"
            raise CacheError(f"{url}: {proto}:// URLs need the {package} package, which is not installed: {how}") from None
        except ValueError as err:  # unknown protocol
            raise CacheError(f"{url}: {err}; use a local path or an fsspec URL (s3://, gs://, memory:// ...)") from None
        self.root = self.root.rstrip("/")
        self.small_arrays = {}
        # files of a local-backed filesystem read into the caller's buffer (mounted filesystems, latency://)
        self.reads_into = isinstance(self.fs, LocalFileSystem)

    def preflight(self) -> None:
        """Object stores: the bucket exists and the endpoint answers (one line each, exit 2)."""
        proto = _protocol(self.url)
        if proto not in _BUCKETED:
            return
        bucket = self.root.split("/", 1)[0]
        where = f"endpoint {_endpoint()}" if proto in ("s3", "s3a") else f"{proto}://"
        try:
            self.fs.invalidate_cache(bucket)
            self.fs.info(bucket)
        except FileNotFoundError:
            raise CacheError(f"{self.url}: bucket {bucket!r} does not exist at {where}: create it (e.g. `aws s3 mb "
                             f"s3://{bucket}`) or fix the URL") from None
        except PermissionError as err:
            raise CacheError(f"{self.url}: access to bucket {bucket!r} at {where} was denied ({err}): check the "
                             "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE)") from None
        except Exception as err:  # noqa: BLE001 -- botocore/aiohttp connection errors have no common base
            raise CacheError(f"{self.url}: cannot reach the object store at {where} ({type(err).__name__}: {err}): "
                             "check AWS_ENDPOINT_URL, the network and the retry settings (docs/cache.md)") from None

    def check_exclusive_create(self) -> None:
        """Create one probe object twice with create-if-absent: the second must be refused."""
        key = f".dflash-probe-{secrets.token_hex(8)}"
        try:
            first = self.create_exclusive(key, b"1")
            second = self.create_exclusive(key, b"2")
        finally:
            with contextlib.suppress(OSError):
                self.remove(key)
        if not first or second:
            raise CacheError(f"{self.url}: this store does not refuse a second create-if-absent (a conditional "
                             f"write such as S3's If-None-Match; probe: first create {first}, second {second}): part "
                             "leases and commit records would not be exclusive, so it is refused. Use a store (and "
                             "fsspec adapter) that honours conditional writes, or a local / shared-filesystem path")

    def _p(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def get(self, key: str) -> bytes:
        return self.fs.cat_file(self._p(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(self._p(key), start=start, end=end)

    def read_into(self, key: str, start: int, buf: memoryview) -> int:
        if not self.reads_into:
            return super().read_into(key, start, buf)
        with self.fs.open(self._p(key), "rb") as f:
            f.seek(start)
            return _fill(f.readinto, buf)

    def get_suffix(self, key: str, n: int) -> bytes:
        """One suffix request (``Range: bytes=-n`` on HTTP stores; a seek from the end elsewhere), not a
        HEAD for the size and then a range GET; filesystems that refuse a negative start get the pair."""
        try:
            return self.fs.cat_file(self._p(key), start=-n)
        except (ValueError, NotImplementedError, TypeError):
            size = self.fs.size(self._p(key))
            return self.fs.cat_file(self._p(key), start=max(0, size - n), end=size)

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache(self._p(key))  # listings cached by s3fs & co. must not hide a new commit or lease
        return self.fs.exists(self._p(key))

    def put(self, key: str, data: bytes, durable: bool = False) -> None:
        self.fs.pipe_file(self._p(key), data)  # one whole object: atomic on object stores

    def create_exclusive(self, key: str, data: bytes, durable: bool = False) -> bool:
        """``pipe_file(mode="create")``: atomic where the filesystem implements it as a conditional write
        (``If-None-Match`` on S3-compatible stores where supported; the memory filesystem); fsspec's
        generic fallback checks, then writes. Threads of this process take turns: the memory filesystem
        (and the generic fallback) check and write in this process, where two threads racing between
        the check and the write could otherwise both win (tests/test_cache_safety.py)."""
        with _CREATE_LOCK:
            try:
                self.fs.pipe_file(self._p(key), data, mode="create")
            except FileExistsError:
                return False
        return True

    def list_dir(self, prefix: str) -> list[str]:
        p = self._p(prefix)
        self.fs.invalidate_cache(p)
        try:
            entries = self.fs.ls(p, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        # (object stores list an object's own key for a key that is an object, not a "directory")
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != p.rstrip("/")})

    def list_files(self, prefix: str) -> dict[str, int]:
        p = self._p(prefix)
        try:
            found = self.fs.find(p, detail=True)
        except FileNotFoundError:
            return {}
        root = self.root.lstrip("/")
        out = {}
        for path, info in found.items():
            rel = path.lstrip("/")[len(root):].lstrip("/")
            out[rel] = int(info.get("size") or 0)
        return out

    def remove(self, key: str) -> None:
        if self.fs.exists(self._p(key)):
            self.fs.rm(self._p(key))

    def remove_tree(self, prefix: str) -> None:
        if self.fs.exists(self._p(prefix)):
            self.fs.rm(self._p(prefix), recursive=True)

    def remove_entry(self, key: str) -> None:
        self.remove_tree(key)

    def remove_empty_dir(self, prefix: str) -> None:
        with contextlib.suppress(OSError):  # filesystems with real (or pseudo) directories
            if not self.fs.ls(self._p(prefix), detail=False):
                self.fs.rmdir(self._p(prefix))

    def root_is_file(self) -> bool:
        return self.fs.isfile(self.root)

    def root_exists(self) -> bool:
        return self.fs.exists(self.root)

    def zarr_store(self, prefix: str) -> Any:
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(f"{self.url}/{prefix}" if prefix else self.url)


def make_storage(url: str) -> Storage:
    url = str(url)
    return LocalStorage(url) if is_local_url(url) else FsspecStorage(url)
