"""Locating, downloading and verifying dataset files.

Nothing here touches the network unless a datamodule was built with ``download=True``: tests and offline
machines only ever read files that are already on disk.
"""

import gzip
import hashlib
import os
import shutil
import tarfile
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are missing; the message names the directory, the missing files and the fix."""


def md5sum(path: PathLike, chunk_size: int = 1 << 20) -> str:
    """Hex MD5 digest of a file (integrity check against the publishers' checksums, not security)."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_url(url: str, destination: PathLike, md5: Optional[str] = None) -> Path:
    """Download ``url`` to ``destination`` unless a verified copy is already there.

    The body goes to a ``.part`` file that is renamed only after its checksum matched, so an interrupted
    download never leaves a file that later looks complete.

    Raises:
        RuntimeError: the downloaded file's MD5 differs from ``md5``.
    """
    destination = Path(destination)
    if destination.is_file() and (md5 is None or md5sum(destination) == md5):
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".part")
    request = urllib.request.Request(url, headers={"User-Agent": "lightning_gradcomp"})
    with urllib.request.urlopen(request, timeout=60) as response, open(partial, "wb") as handle:
        shutil.copyfileobj(response, handle)
    if md5 is not None:
        got = md5sum(partial)
        if got != md5:
            partial.unlink()
            raise RuntimeError(f"Downloaded {url} has MD5 {got}, expected {md5}; retry or fetch it by hand.")
    partial.replace(destination)
    return destination


def extract_archive(archive: PathLike, destination: PathLike) -> None:
    """Extract a ``.tar(.gz|.bz2|.xz)``, ``.tgz`` or ``.zip`` archive, or gunzip a single ``.gz`` file."""
    archive, destination = Path(archive), Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as handle:
            handle.extractall(destination)
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as handle:
            if hasattr(tarfile, "data_filter"):
                # refuses absolute paths and links that escape the destination (Python >= 3.10.12 / 3.11.4)
                handle.extractall(destination, filter="data")
            else:
                handle.extractall(destination)
    elif archive.suffix == ".gz":
        with gzip.open(archive, "rb") as src, open(destination / archive.stem, "wb") as dst:
            shutil.copyfileobj(src, dst)
    else:
        raise ValueError(f"Expected `archive` to be a tar, zip or .gz file, but got {str(archive)!r}.")


def find_file(directory: PathLike, name: str) -> Optional[Path]:
    """``directory/name`` or its gzipped twin ``directory/name.gz``, whichever exists first."""
    for candidate in (Path(directory) / name, Path(directory) / (name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def require_files(
    dataset: str, directory: PathLike, names: Sequence[str], fix: str, allow_gz: bool = False
) -> list[Path]:
    """Return the paths of ``names`` in ``directory``, or raise one error listing every missing file.

    Raises:
        DatasetNotFoundError: some files are missing; the message names the directory and ``fix``.
    """
    found: list[Path] = []
    missing: list[str] = []
    for name in names:
        path = find_file(directory, name) if allow_gz else (Path(directory) / name)
        if path is None or not path.is_file():
            missing.append(name + ("[.gz]" if allow_gz else ""))
        else:
            found.append(path)
    if missing:
        raise DatasetNotFoundError(
            f"{dataset} not found in {str(Path(directory).resolve())!r}: missing {', '.join(missing)}. Fix: {fix}."
        )
    return found
