"""Object storage through fsspec: `s3://` (s3fs), `gs://` (gcsfs) or any fsspec URL, and plain local paths.

    if is_url(location):
        with storage_errors(location, "reading the store"):
            fetch(f"{location}/manifest.json", local_path)
    publish(Path("runs/x/metrics.jsonl"), "s3://bucket/runs/x/metrics.jsonl")

Every upload is a complete object: an object store shows an object only once its PUT (or multipart
upload) completes, and a local destination is written to a temporary name and renamed. Credentials and
endpoints come from the usual places (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile,
AWS_ENDPOINT_URL for an S3-compatible server); fsspec and its backends are imported only for a URL.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Iterator

from moelab.errors import DataError
from moelab.files import atomic_path

__all__ = ["is_url", "join", "storage_errors", "fetch", "read_bytes", "exists", "check_writable", "upload", "publish"]


def is_url(location: str | Path) -> bool:
    """Whether `location` names object storage (`s3://bucket/key`, `gs://...`) rather than a local path."""
    return "://" in str(location) and not str(location).startswith("file://")


def join(location: str, *parts: str) -> str:
    return "/".join([str(location).rstrip("/"), *parts])


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise DataError(f"{url}: object storage needs fsspec and its backend (s3fs for s3://, gcsfs for gs://); "
                        "run `pip install 'moelab[data]'`.") from None
    try:
        return url_to_fs(url)
    except (ImportError, ValueError) as e:
        raise DataError(f"{url}: no fsspec backend for this URL ({e}); install it (s3fs for s3://, gcsfs for "
                        "gs://) or use a local path.") from None
    except Exception as e:  # a backend that connects as it is built (ftp://, sftp://): no such host, refused login
        with storage_errors(url, "connecting to"):
            raise e


_CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                      "DefaultCredentialsError", "RefreshError")


@contextlib.contextmanager
def storage_errors(url: str, action: str) -> Iterator[None]:
    """Turn an object-storage failure into one DataError naming `url`, what was being done, and the fix."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:
        name = type(e).__name__
        chain = f"{name} {e} {type(e.__cause__).__name__ if e.__cause__ else ''} {e.__cause__ or ''}"
        first = str(e).splitlines()[0] if str(e) else name
        if any(c in chain for c in _CREDENTIAL_ERRORS) or isinstance(e, PermissionError):
            raise DataError(f"{action} {url} failed: missing or refused credentials ({first}). Set "
                            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, "
                            "GOOGLE_APPLICATION_CREDENTIALS for gs://, with access to that bucket.") from None
        if isinstance(e, FileNotFoundError):
            raise DataError(f"{action} {url} failed: it does not exist ({first}); check the bucket and the path.") from None
        raise DataError(f"{action} {url} failed: unreachable ({name}: {first}). Check the URL, the network and, "
                        "for an S3-compatible server, AWS_ENDPOINT_URL.") from None


def fetch(url: str, local: Path) -> None:
    """Download `url` to `local`, through a temporary name: `local` is either absent or complete."""
    fs, path = _filesystem(url)
    local.parent.mkdir(parents=True, exist_ok=True)
    with storage_errors(url, "downloading"), atomic_path(local) as tmp:
        fs.get_file(path, str(tmp))


def exists(location: str | Path) -> bool:
    """Whether `location` (a URL or a local path) names an existing file or object."""
    if not is_url(location):
        return Path(location).is_file()
    fs, path = _filesystem(str(location))
    with storage_errors(str(location), "reaching"):
        return bool(fs.exists(path))


def read_bytes(url: str) -> bytes:
    """The content of `url`, or of a local path."""
    if not is_url(url):
        return Path(url).read_bytes()
    fs, path = _filesystem(url)
    with storage_errors(url, "reading"):
        return fs.cat_file(path)


def check_writable(url: str) -> None:
    """Reach `url`'s bucket once (listing it): DataError now, naming it, if it is unreachable, refused or absent."""
    fs, path = _filesystem(url)
    bucket = path.split("/")[0]
    with storage_errors(url, "reaching"):
        fs.ls(bucket, refresh=True)


def upload(local: Path, url: str) -> None:
    """Copy `local` to `url` as one complete object."""
    fs, path = _filesystem(url)
    with storage_errors(url, "uploading to"):
        fs.put_file(str(local), path)


def publish(local: Path, destination: str) -> None:
    """Copy `local` to `destination` (a URL or a local path); readers never see a half-written file."""
    if is_url(destination):
        upload(local, destination)
        return
    target = Path(destination)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        shutil.copyfile(local, tmp)
