"""The token store: every domain tokenized once into sharded, memory-mappable arrays, sealed by a manifest.

    manifest = prepare(cfg.data, "stores/web", on_progress=...)   # `moelab data prepare CONFIG --out STORE`
    store = open_store("stores/web")          # or s3://bucket/stores/web: fetched once into a local cache
    train, heldout = store.streams("web")     # TokenStreams: read a window at a time, never the whole corpus

A store on disk:

    STORE/prepare.json                      what is being prepared (settings, source hashes): a resume checks it
    STORE/tokenizer.json                    the Hugging Face tokenizer (a BPE trained here, or the one given)
    STORE/<domain>/<split>-<k>.tokens.npy   uint16 (or uint32) ids: documents in order, each followed by eos
    STORE/<domain>/<split>-<k>.docs.npy     int64: the end offset of each document within the shard
    STORE/<domain>/<split>-<k>.json         the shard's record, written after both arrays are complete
    STORE/manifest.json                     written last: every file's size and SHA-256, sources, token counts,
                                            and the store's content hash

`split` is `train` or `heldout`. Documents stream by in source order; document i of a domain is held out
when `floor((i + 1) f + 1/2) > floor(i f + 1/2)` for `data.heldout_fraction` f: whole documents, evenly
spaced, decided without knowing how many there are (with f = 0.1: documents 4, 14, 24, ...). A domain
too small for that rule to pick one holds out its last document; a lone document is cut at line
boundaries first, as the in-memory corpus does. A shard closes once it holds `shard_tokens` tokens.

Resuming a killed `prepare`: each array is written to a `.tmp` name and renamed, and a shard counts as
finished only once its record exists and its arrays match the record's hashes, so a killed run never
leaves a shard that passes for complete. The next run skips every finished shard (reading, but not
tokenizing, the documents they hold) and rewrites the rest. Without a manifest a directory is not a store.

Reading: `open_store` checks the manifest against the files (every listed file present with its size and
SHA-256, no unlisted shard). Hashes are re-read only for files whose size or mtime changed since the last
check (`.verified.json`), so a start-up after the first costs a stat per file, not a read of the corpus.
The content hash (`store_hash`) covers the token arrays and the tokenizer, not where the sources lay.

Why plain `.npy` files read by position (docs/data.md "Data at scale" has the measurements): a window of the
`(seed, step)` sampler is one `pread`, with no chunk to decode around it (TensorStore's zarr and Arrow IPC
were measured slower on exactly those reads), and memory holds only the windows read (a memory map held
the kernel's page-cache folios around each window); the files are plain arrays any tool can memory-map;
object storage is a copy of whole shards (fsspec), verified by hash, into a local cache.

Why one module past 600 lines: writing, resuming and verifying a store are one file format's three
sides; each change to the format touches all three, so they stay side by side.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moelab.config import DataConfig, DomainConfig
from moelab.data import remote
from moelab.data.sources import _CHUNKS_FOR_A_SINGLE_DOCUMENT, _split_at_lines, iter_documents, source_files
from moelab.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from moelab.errors import DataError
from moelab.files import atomic_open, atomic_path, sha256_file, write_json

__all__ = ["FORMAT", "MANIFEST", "SPLITS", "DEFAULT_SHARD_TOKENS", "ShardFile", "TokenStream", "Store", "prepare", "open_store",
           "read_manifest", "store_hashes", "is_heldout", "split_stream"]

FORMAT = "moelab-token-store/1"
MANIFEST = "manifest.json"
PLAN = "prepare.json"
TOKENIZER = "tokenizer.json"
VERIFIED = ".verified.json"
REHASH_ENV = "MOELAB_REHASH_STORES"  # "1": every open_store re-hashes every file (`moelab train --verify-data`)
SPLITS = ("train", "heldout")
DEFAULT_SHARD_TOKENS = 1 << 24  # 16M tokens: 32 MB of uint16 per shard
_BATCH_BYTES = 1 << 22  # text handed to the tokenizer at once (encode_batch threads over it)
_CACHE_ENV = "MOELAB_STORE_CACHE"  # where stores fetched from object storage are kept (default ~/.cache/moelab)

Progress = Callable[[int, int], None]  # (tokens written so far, text bytes read so far)


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


# ----------------------------------------------------------------------------------------------
# reading: token streams


class ShardFile:
    """One `.npy` shard read by position (`pread`): its dtype, its length and where its data starts."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, self.dtype = read_header(f)
            self.offset = f.tell()
        self.path, self.length = path, int(shape[0])
        self._fd: int | None = None

    def read(self, start: int, count: int) -> np.ndarray:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        size = self.dtype.itemsize
        data = os.pread(self._fd, count * size, self.offset + start * size)
        return np.frombuffer(data, dtype=self.dtype)

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


class TokenStream:
    """One long int32 token stream over several shards: `len(s)`, `s[index_array]`, `s[a:b]`.

    What `mixture.sample_batch` and `eval_batches` read (`stream[starts[:, None] + arange(window)]`), so a
    store-backed corpus samples exactly as an in-memory one; a window may cross a shard boundary. Each run of
    consecutive indices (a window) is one `pread`: memory holds the windows read and nothing else. (Memory-
    mapping the same files maps the kernel's whole page-cache folios around every window: measured, the
    resident set of a 2 GB corpus grew to 3.4 GB after 1000 batches.)
    """

    def __init__(self, shards: list[ShardFile]):
        self._shards = shards
        self._starts = np.cumsum([0, *(s.length for s in shards)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: Any) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(len(self)))
        index = np.asarray(index, dtype=np.int64)
        flat = index.ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        breaks = np.flatnonzero(np.diff(flat) != 1) + 1  # runs of consecutive indices: one read each
        out = np.empty(flat.shape, dtype=np.int32)
        for lo, hi in zip(np.r_[0, breaks], np.r_[breaks, flat.size]):
            out[lo:hi] = self._read(int(flat[lo]), int(hi - lo))
        return out.reshape(index.shape)

    def _read(self, start: int, count: int) -> np.ndarray:
        parts = []
        while count:
            k = int(np.searchsorted(self._starts, start, side="right")) - 1
            take = min(count, int(self._starts[k + 1]) - start)
            parts.append(self._shards[k].read(start - int(self._starts[k]), take))
            start, count = start + take, count - take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole stream in memory (for small held-out statistics only)."""
        whole = self[np.arange(len(self))]
        return whole if dtype is None else whole.astype(dtype)


# ----------------------------------------------------------------------------------------------
# the held-out rule


def is_heldout(index: int, fraction: float) -> bool:
    """Whether document `index` of a domain is held out: evenly spaced at rate `fraction`, streamable."""
    return math.floor((index + 1) * fraction + 0.5) > math.floor(index * fraction + 0.5)


def split_stream(documents: Iterable[str], fraction: float, where: str) -> Iterator[tuple[int, str, str]]:
    """(index, split, document) for each document, in order (module docstring: the held-out rule).

    Raises:
        DataError: the domain has no document, or a single one too short to cut in two.
    """
    documents = iter(documents)
    first, second = next(documents, None), next(documents, None)
    if first is None:
        raise DataError(f"{where} holds no document with text (empty documents are dropped); add data to it or "
                        "remove the domain.")
    if second is None:  # a lone document: cut it at line boundaries, as the in-memory corpus does
        chunks = _split_at_lines(first, _CHUNKS_FOR_A_SINGLE_DOCUMENT)
        if len(chunks) < 2:
            raise DataError(f"{where} holds a single line of text, too little to hold part of it out for "
                            "evaluation; add more lines, documents or files.")
        documents, first, second = iter(chunks[2:]), chunks[0], chunks[1]
    # One document of lookahead: the last one is held out if the rule picked none before it.
    pending, index, held = first, 0, 0
    for nxt in itertools.chain([second], documents):
        split = "heldout" if is_heldout(index, fraction) else "train"
        held += split == "heldout"
        yield index, split, pending
        pending, index = nxt, index + 1
    yield index, ("heldout" if held == 0 or is_heldout(index, fraction) else "train"), pending


# ----------------------------------------------------------------------------------------------
# writing: prepare


class _ShardWriter:
    """Accumulates one split's documents and writes a shard each time `shard_tokens` is reached."""

    def __init__(self, folder: Path, split: str, index: int, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.index, self.dtype, self.shard_tokens = folder, split, index, dtype, shard_tokens
        self.parts: list[np.ndarray] = []
        self.ends: list[int] = []
        self.size = 0

    def add(self, tokens: np.ndarray, next_document: int) -> None:
        self.parts.append(tokens)
        self.size += len(tokens)
        self.ends.append(self.size)
        self.next_document = next_document
        if self.size >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.parts:
            return
        stem = f"{self.split}-{self.index:05d}"
        arrays = {"tokens": np.concatenate(self.parts).astype(self.dtype), "docs": np.asarray(self.ends, np.int64)}
        record = {"split": self.split, "index": self.index, "num_tokens": self.size, "num_documents": len(self.ends),
                  "next_document": self.next_document, "files": {}}
        for kind, array in arrays.items():
            path = self.folder / f"{stem}.{kind}.npy"
            with atomic_open(path, "wb") as f:
                np.save(f, array)
            record["files"][kind] = {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
        write_json(self.folder / f"{stem}.json", record)  # last: the shard now counts as finished
        self.parts, self.ends, self.size, self.index = [], [], 0, self.index + 1


def _finished_shards(folder: Path) -> dict[str, list[dict]]:
    """Each split's finished shards, in order: records whose arrays match; anything after a gap is dropped."""
    done: dict[str, list[dict]] = {split: [] for split in SPLITS}
    for split in SPLITS:
        index = 0
        while (folder / f"{split}-{index:05d}.json").is_file():
            record = json.loads((folder / f"{split}-{index:05d}.json").read_text())
            if not all((folder / f["name"]).is_file() and sha256_file(folder / f["name"]) == f["sha256"]
                       for f in record["files"].values()):
                break
            done[split].append(record)
            index += 1
    return done


def _source_entries(domain: DomainConfig, cfg: DataConfig) -> list[dict]:
    """Provenance of a domain's sources: path, size and SHA-256 of each file (a dataset folder: of its files)."""
    if domain.kind == "embedded":
        digest = hashlib.sha256()
        size = 0
        for doc in iter_documents(domain, cfg.max_bytes_per_domain, cfg.seed, cfg.arithmetic_digits):
            data = doc.encode("utf-8")
            digest.update(data)
            size += len(data)
        return [{"path": f"embedded:{domain.name}", "bytes": size, "sha256": digest.hexdigest()}]
    entries = []
    for name in source_files(domain):
        path = Path(name)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            digest = hashlib.sha256()
            for p in files:
                digest.update(f"{p.relative_to(path)}\0{sha256_file(p)}\n".encode())
            entries.append({"path": name, "bytes": sum(p.stat().st_size for p in files), "sha256": digest.hexdigest()})
        elif path.is_file():
            entries.append({"path": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)})
        else:  # an hf: name, or a file the reader will name as missing
            entries.append({"path": name, "bytes": None, "sha256": None})
    return entries


def _staging_dir(out: str) -> Path:
    if not remote.is_url(out):
        return Path(out)
    return _cache_root() / "prepare" / hashlib.sha256(out.encode()).hexdigest()[:16]


def _cache_root() -> Path:
    return Path(os.environ.get(_CACHE_ENV) or Path.home() / ".cache" / "moelab" / "stores")


def _build_tokenizer(cfg: DataConfig, root: Path, where_docs: Callable[[], Iterator[str]]) -> Tokenizer:
    """The store's tokenizer: byte; a BPE trained on the train documents (once: a resume reloads it); or a copy
    of the given tokenizer.json."""
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    saved = root / TOKENIZER
    if cfg.tokenizer != "bpe":
        source = HFTokenizer.load(cfg.tokenizer)  # DataError naming a missing or invalid file
        with atomic_path(saved) as tmp:
            shutil.copyfile(cfg.tokenizer, tmp)
        return source
    if saved.is_file():
        return HFTokenizer.load(saved)
    tokenizer = HFTokenizer.train_bpe(where_docs(), cfg.bpe_vocab_size)
    with atomic_path(saved) as tmp:
        tokenizer.save(tmp)
    return tokenizer


def prepare(cfg: DataConfig, out: str | Path, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            on_progress: Progress | None = None) -> dict:
    """Tokenize every domain of `cfg` into a token store at `out` (a folder, or an s3:// / gs:// URL); returns
    its manifest. Rerun after a kill, it resumes without redoing finished shards; on a finished store it does
    nothing.

    A URL store is prepared in a local staging folder and uploaded file by file, the manifest last.

    Raises:
        DataError: a bad source (named), an empty domain, a store prepared from other sources or settings.
    """
    out = str(out)
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens={shard_tokens} is invalid: must be >= 1 (default {DEFAULT_SHARD_TOKENS}).")
    root = _staging_dir(out)
    if root.exists() and not root.is_dir():
        raise DataError(f"--out {root} is an existing file; pass a folder for the store.")
    root.mkdir(parents=True, exist_ok=True)
    plan = {"format": FORMAT, "heldout_fraction": cfg.heldout_fraction, "tokenizer": cfg.tokenizer,
            "bpe_vocab_size": cfg.bpe_vocab_size, "shard_tokens": shard_tokens,
            "domains": {d.name: {"kind": d.kind, "sources": _source_entries(d, cfg)} for d in cfg.domains}}
    if cfg.tokenizer not in ("byte", "bpe"):
        plan["tokenizer_sha256"] = sha256_file(Path(cfg.tokenizer)) if Path(cfg.tokenizer).is_file() else None
    if (root / PLAN).is_file() and json.loads((root / PLAN).read_text()) != plan:
        raise DataError(f"{out} holds a store prepared from other sources or settings (its {PLAN} differs); "
                        "pass a new --out, or delete that folder to prepare it afresh.")
    if (root / MANIFEST).is_file():
        manifest = json.loads((root / MANIFEST).read_text())
        if remote.is_url(out):
            _upload(root, out, manifest)
        return manifest
    write_json(root / PLAN, plan)

    def documents(domain: DomainConfig) -> Iterator[tuple[int, str, str]]:
        stream = iter_documents(domain, cfg.max_bytes_per_domain, cfg.seed, cfg.arithmetic_digits)
        return split_stream(stream, cfg.heldout_fraction, f"data.domains[{domain.name}]")

    def train_documents() -> Iterator[str]:
        for domain in cfg.domains:
            yield from (doc for _, split, doc in documents(domain) if split == "train")

    tokenizer = _build_tokenizer(cfg, root, train_documents)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    counter = {"tokens": 0, "bytes": 0}
    for domain in cfg.domains:
        _prepare_domain(root / domain.name, documents(domain), tokenizer, dtype, shard_tokens, counter, on_progress)
    manifest = _seal(root, plan, tokenizer, dtype)
    if remote.is_url(out):
        _upload(root, out, manifest)
    return manifest


def _prepare_domain(folder: Path, documents: Iterator[tuple[int, str, str]], tokenizer: Tokenizer, dtype: np.dtype,
                    shard_tokens: int, counter: dict, on_progress: Progress | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob("*.tmp"):  # a kill mid-write: never a shard
        leftover.unlink()
    done = _finished_shards(folder)
    for split in SPLITS:  # shards past the last finished one are stale: they are written again
        for path in folder.glob(f"{split}-*"):
            if int(path.name.split("-")[1].split(".")[0]) >= len(done[split]):
                path.unlink()
    skip = {split: records[-1]["next_document"] if records else 0 for split, records in done.items()}
    writers = {split: _ShardWriter(folder, split, len(done[split]), dtype, shard_tokens) for split in SPLITS}
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    batch: list[tuple[int, str, str]] = []
    size = 0

    def write(batch: list[tuple[int, str, str]], encoded: Future) -> None:
        for (index, split, _), ids in zip(batch, encoded.result()):
            tokens = np.concatenate([ids, eos])
            writers[split].add(tokens, index + 1)
            counter["tokens"] += len(tokens)
        if on_progress:
            on_progress(counter["tokens"], counter["bytes"])

    # One batch in flight: the tokenizer encodes it on both cores (it releases the GIL) while this thread
    # reads and parses the next one and writes the previous one's tokens, in document order.
    in_flight: tuple[list, Future] | None = None
    with ThreadPoolExecutor(max_workers=1) as pool:
        for index, split, doc in itertools.chain(documents, [(-1, "", "")]):
            if index >= 0:
                if index < skip[split]:
                    continue  # in a finished shard
                batch.append((index, split, doc))
                size += len(doc)
                counter["bytes"] += len(doc)
            if batch and (size >= _BATCH_BYTES or index < 0):
                submitted = (batch, pool.submit(tokenizer.encode_batch, [d for _, _, d in batch]))
                if in_flight is not None:
                    write(*in_flight)
                in_flight, batch, size = submitted, [], 0
        if in_flight is not None:
            write(*in_flight)
    for writer in writers.values():
        writer.flush()


def _seal(root: Path, plan: dict, tokenizer: Tokenizer, dtype: np.dtype) -> dict:
    """Write the manifest from the finished shards: files, token counts, sources and the content hash."""
    files: dict[str, dict] = {}
    domains: dict[str, dict] = {}
    for name, entry in plan["domains"].items():
        done = _finished_shards(root / name)
        splits = {}
        for split in SPLITS:
            shards = []
            for record in done[split]:
                names = {kind: f"{name}/{f['name']}" for kind, f in record["files"].items()}
                for kind, f in record["files"].items():
                    files[names[kind]] = {"bytes": f["bytes"], "sha256": f["sha256"]}
                shards.append({"tokens": names["tokens"], "docs": names["docs"], "num_tokens": record["num_tokens"],
                               "num_documents": record["num_documents"]})
            splits[split] = {"num_tokens": sum(s["num_tokens"] for s in shards),
                             "num_documents": sum(s["num_documents"] for s in shards), "shards": shards}
        domains[name] = {**entry, "splits": splits}
    kind = "byte" if isinstance(tokenizer, ByteTokenizer) else "hf"
    tokenizer_entry = {"kind": kind, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    if kind == "hf":
        files[TOKENIZER] = {"bytes": (root / TOKENIZER).stat().st_size, "sha256": sha256_file(root / TOKENIZER)}
        tokenizer_entry["file"] = TOKENIZER
    content = {"format": FORMAT, "dtype": dtype.name, "tokenizer": tokenizer_entry,
               "files": {k: v["sha256"] for k, v in sorted(files.items())}}
    manifest = {"format": FORMAT, "dtype": dtype.name, "tokenizer": tokenizer_entry,
                "heldout_fraction": plan["heldout_fraction"], "domains": domains, "domain_order": list(domains),
                "files": files,
                "store_hash": hashlib.sha256(_canonical(content).encode()).hexdigest()}
    write_json(root / MANIFEST, manifest)
    return manifest


def _upload(root: Path, url: str, manifest: dict) -> None:
    for name in [PLAN, *manifest["files"]]:
        remote.upload(root / name, remote.join(url, name))
    remote.upload(root / MANIFEST, remote.join(url, MANIFEST))  # last: the store exists once this lands


# ----------------------------------------------------------------------------------------------
# reading: open a store


@dataclass(frozen=True)
class Store:
    """A verified token store: its manifest and the local folder its shards are read from."""

    location: str  # as given: a folder or a URL
    root: Path  # local: the folder itself, or the cache a URL store was fetched into
    manifest: dict

    @property
    def store_hash(self) -> str:
        return self.manifest["store_hash"]

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(self.manifest["domain_order"])

    def tokenizer(self) -> Tokenizer:
        entry = self.manifest["tokenizer"]
        return ByteTokenizer() if entry["kind"] == "byte" else HFTokenizer.load(self.root / entry["file"])

    def streams(self, domain: str) -> tuple[TokenStream, TokenStream]:
        """(train, held-out) token streams of `domain`, read from its shards by position."""
        if domain not in self.manifest["domains"]:
            raise DataError(f"data.domains[{domain}]: the token store {self.location} has no domain {domain} (it holds "
                            f"{', '.join(self.domains)}); prepare it into the store or rename the domain.")
        splits = self.manifest["domains"][domain]["splits"]
        return tuple(TokenStream([ShardFile(self.root / s["tokens"]) for s in splits[split]["shards"]])
                     for split in SPLITS)

    def summary(self) -> dict:
        """Sources (path, size, SHA-256) and token counts per domain and split, for run directories and reports."""
        return {"location": self.location, "store_hash": self.store_hash, "tokenizer": self.manifest["tokenizer"],
                "domains": {name: {"sources": d["sources"],
                                   "tokens": {split: d["splits"][split]["num_tokens"] for split in SPLITS},
                                   "documents": {split: d["splits"][split]["num_documents"] for split in SPLITS}}
                            for name, d in ((n, self.manifest["domains"][n]) for n in self.domains)}}


def open_store(location: str | Path, rehash: bool | None = None) -> Store:
    """Open and verify the token store at `location` (a folder, or a URL fetched into a local cache).

    What is checked when: the manifest's structure and its `store_hash` (recomputed from the files it lists)
    every time; every listed file's size every time; its SHA-256 when the file's (size, mtime, inode, ctime)
    differ from the last verified ones in `.verified.json` (a restored mtime still moves the ctime, and a copy
    moves the inode), and every file's SHA-256 with `rehash` (`moelab data show --verify`, `moelab train
    --verify-data`, which sets REHASH_ENV for the run and its workers; `rehash` None reads it).

    Raises:
        DataError: no manifest (not a store, or a prepare that did not finish), a manifest that does not match
            the files (a shard missing, unlisted, truncated or with another hash: named), an unreachable URL or
            missing credentials.
    """
    location = str(location)
    root = _fetch(location) if remote.is_url(location) else Path(location)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        unfinished = (root / PLAN).is_file()
        raise DataError(
            f"{location} is not a token store: it has no {MANIFEST}"
            + (" (a `moelab data prepare` into it did not finish; rerun the same command to complete it)."
               if unfinished else "; prepare one with `moelab data prepare CONFIG --out STORE`."))
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"{location}/{MANIFEST} is not JSON ({type(e).__name__}); prepare the store again.") from None
    problem = manifest_problem(manifest)
    if problem is None and manifest_path.read_text() != json.dumps(manifest, indent=1, sort_keys=True):
        problem = "its text is not what `moelab data prepare` writes for its content (the file was edited)"
    if problem:
        raise DataError(f"{location}/{MANIFEST} is not a valid {FORMAT} manifest: {problem}. Copy the store again "
                        "or prepare it again; nothing was read from it.")
    if rehash is None:
        rehash = os.environ.get(REHASH_ENV) == "1"
    _verify(location, root, manifest["files"], rehash)
    return Store(location, root, manifest)


def _content_hash(manifest: dict) -> str:
    content = {"format": FORMAT, "dtype": manifest["dtype"], "tokenizer": manifest["tokenizer"],
               "files": {k: v["sha256"] for k, v in sorted(manifest["files"].items())}}
    return hashlib.sha256(_canonical(content).encode()).hexdigest()


def manifest_problem(manifest: Any) -> str | None:
    """What keeps `manifest` from being a store's, in one phrase (a key, a type, a path out of the store, a
    store_hash that its files no longer give), or None: checked before any of it is used."""
    if not isinstance(manifest, dict):
        return f"it is a JSON {type(manifest).__name__}, not an object"
    for key, kind in (("format", str), ("dtype", str), ("tokenizer", dict), ("files", dict), ("domains", dict),
                      ("domain_order", list), ("store_hash", str)):
        if not isinstance(manifest.get(key), kind):
            return f"{key!r} is missing or not a {kind.__name__}"
    if manifest["format"] != FORMAT:
        return f"format is {manifest['format']!r}, not {FORMAT!r}"
    if manifest["dtype"] not in ("uint16", "uint32"):
        return f"dtype {manifest['dtype']!r} is not uint16 or uint32"
    token = manifest["tokenizer"]
    if not (token.get("kind") in ("byte", "hf") and _count(token.get("vocab_size")) and _count(token.get("eos_id"), 0)):
        return "tokenizer must hold kind (byte or hf), vocab_size and eos_id"
    for name, entry in manifest["files"].items():
        path = Path(name)
        if path.is_absolute() or ".." in path.parts or not name:
            return f"file {name!r} is not a path inside the store"
        if not (isinstance(entry, dict) and _count(entry.get("bytes"), 0) and isinstance(entry.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            return f"file {name!r} must have bytes (an integer) and sha256 (64 hex digits)"
    order = manifest["domain_order"]
    if not (all(isinstance(d, str) for d in order) and sorted(order) == sorted(manifest["domains"])):
        return "domain_order does not list each domain once"
    for name, domain in manifest["domains"].items():
        splits = domain.get("splits") if isinstance(domain, dict) else None
        if not (isinstance(splits, dict) and set(splits) == set(SPLITS)):
            return f"domain {name!r} must have the splits {', '.join(SPLITS)}"
        for split, entry in splits.items():
            shards = entry.get("shards") if isinstance(entry, dict) else None
            if not (isinstance(shards, list) and _count(entry.get("num_tokens"), 0)):
                return f"domain {name!r} split {split!r} must have num_tokens and a list of shards"
            for shard in shards:
                if not (isinstance(shard, dict) and shard.get("tokens") in manifest["files"]
                        and shard.get("docs") in manifest["files"] and _count(shard.get("num_tokens"), 0)
                        and _count(shard.get("num_documents"), 0)):
                    return f"domain {name!r} split {split!r} has a shard that is not a listed tokens/docs pair"
    if _content_hash(manifest) != manifest["store_hash"]:
        return "its store_hash is not the hash of the files it lists (the manifest was edited)"
    return None


def _count(value: Any, least: int = 1) -> bool:
    """An integer (not a bool) >= least."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def read_manifest(location: str | Path) -> dict:
    """A store's manifest alone (one small read, local or remote), without verifying its shards: for naming a
    store's content hash, e.g. in an experiment's version. DataError if there is none."""
    location = str(location)
    try:
        if remote.is_url(location):
            return json.loads(remote.read_bytes(remote.join(location, MANIFEST)))
        return json.loads((Path(location) / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{location} is not a token store: its {MANIFEST} cannot be read ({e}); prepare one with "
                        "`moelab data prepare CONFIG --out STORE`.") from None


def store_hashes(cfg: DataConfig) -> dict[str, str]:
    """The content hash of the store each domain reads ({} when the data is built in memory)."""
    hashes: dict[str, str] = {}
    for domain in cfg.domains:
        location = domain.store or cfg.store
        if location:
            hashes[domain.name] = read_manifest(location)["store_hash"]
    return hashes


def _verify(location: str, root: Path, files: dict[str, dict], rehash: bool = False) -> None:
    listed = set(files)
    on_disk = {str(p.relative_to(root)) for p in root.glob("*/*.npy")}
    extra = sorted(on_disk - listed)
    if extra:
        raise DataError(f"the manifest of token store {location} does not match its shards: {extra[0]} is not in "
                        f"{MANIFEST} ({len(extra)} unlisted file(s)); prepare the store again into a new folder.")
    cache_path = root / VERIFIED
    try:
        cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    except ValueError:
        cache = {}
    fresh = {}
    for name, entry in sorted(files.items()):
        path = root / name
        if path.is_symlink() or not path.is_file():
            raise DataError(f"token store {location}: {name} is listed in {MANIFEST} but missing (or not a plain "
                            "file); nothing was read from the store. Copy the store again or prepare it again.")
        stat = path.stat()
        if stat.st_size != entry["bytes"]:
            raise DataError(f"token store {location}: {name} is truncated or damaged ({stat.st_size} bytes, the "
                            f"manifest says {entry['bytes']}); nothing was read from the store. Copy the store "
                            "again or prepare it again.")
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns, entry["sha256"]]
        if rehash or cache.get(name) != key:
            actual = sha256_file(path)
            if actual != entry["sha256"]:
                raise DataError(f"token store {location}: {name} is corrupted (SHA-256 {actual[:12]}..., the "
                                f"manifest says {entry['sha256'][:12]}...); nothing was read from the store. Copy "
                                "the store again or prepare it again.")
        fresh[name] = key
    if fresh != cache:
        try:
            write_json(cache_path, fresh)
        except OSError:
            pass  # a read-only store: verified again next time


def _fetch(url: str) -> Path:
    """A local copy of the store at `url`: its manifest, then each listed file not already cached with its hash."""
    root = _cache_root() / hashlib.sha256(url.encode()).hexdigest()[:16]
    manifest_url = remote.join(url, MANIFEST)
    data = remote.read_bytes(manifest_url)
    try:
        manifest = json.loads(data)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{manifest_url} is not a valid {FORMAT} manifest ({e}); prepare the store again.") from None
    root.mkdir(parents=True, exist_ok=True)
    for name, entry in files.items():
        local = root / name
        if not (local.is_file() and local.stat().st_size == entry["bytes"]):  # `_verify` then checks its hash
            remote.fetch(remote.join(url, name), local)
    write_json(root / MANIFEST, manifest)  # `open_store` then verifies every file against it
    return root

