"""The token store's figures (issue 17): prepare speed, start-up and memory against corpus size, sampler
headroom, and the storage libraries compared on the reads the sampler makes.

    python benchmarks/data_store.py --json                       # 200 MB and 2 GB corpora (about 10 min on 2 cores)
    python benchmarks/data_store.py --sizes 20e6,200e6 --json    # a quick pass
    python benchmarks/data_store.py --json --out benchmarks/results/data-store-cpu-DATE.json

What it measures, each on text it generates (documents of words from a fixed Zipf-like vocabulary, in
.jsonl files of 64 MB):
- prepare: tokens/s of `moelab.data.store.prepare` with a saved 8192-token BPE, against the bare
  `tokenizers` batch-encode rate (`encode_batch_fast`, both cores) on the same documents in the same run;
- per corpus size (a byte-tokenized store each): the first open (every shard hashed), the data start-up
  of a fresh process (open + verify by stat + held-out eval sets + first batch) and its peak RSS after
  200 batches, and a whole `moelab train --preset tiny` of 30 steps from the store: wall time, peak RSS;
- sampler headroom: `sample_batch` batches/s from the store at tiny's shape against tiny's own steps/s;
- libraries: random windows (the sampler's reads: 16 windows of seq_len + 1 tokens per batch) and a
  sequential scan, from the same tokens held as our `.npy` memmap, a TensorStore zarr array (Levanter's
  choice) and an Arrow IPC file memory-mapped (what Hugging Face `datasets` keeps on disk), and the same
  `.npy` read by position as training reads it (`TokenStream`).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FILE_BYTES = 64 << 20
WINDOW = 129  # tiny's seq_len + 1
ROWS = 16  # tiny's batch size


def make_corpus(folder: Path, total_bytes: float, seed: int = 0) -> Path:
    """Generated .jsonl files holding about `total_bytes` of text; returns the data YAML for them."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(2, 9, 5000)]
    weights = 1.0 / np.arange(1, len(words) + 1)  # Zipf-like: a few words are most of the text
    sentences = [" ".join(words[i] for i in rng.choice(len(words), size=12, p=weights / weights.sum())) + ".\n"
                 for _ in range(20000)]
    written, index = 0, 0
    while written < total_bytes:
        path = folder / f"part-{index:04d}.jsonl"
        with open(path, "w") as f:
            size = 0
            while size < FILE_BYTES and written + size < total_bytes:
                picks = rng.integers(0, len(sentences), size=int(rng.integers(8, 60)))
                line = json.dumps({"text": "".join(sentences[i] for i in picks)}) + "\n"
                f.write(line)
                size += len(line)
        written += size
        index += 1
    data_yaml = folder / "data.yaml"
    data_yaml.write_text("data:\n  domains:\n    - {name: web, kind: files, paths: ['part-*.jsonl']}\n")
    return data_yaml


def _data_config(data_yaml: Path, **fields):
    from moelab.config import DataConfig, from_dict, read_data_yaml

    return from_dict({**read_data_yaml(data_yaml), **fields}, DataConfig)


def bench_prepare(work: Path, sample_bytes: float) -> dict:
    """Prepare with a saved BPE against bare `tokenizers` batch encoding of the same documents."""
    from moelab.data.sources import iter_file_documents
    from moelab.data.store import prepare
    from moelab.data.tokenizer import HFTokenizer

    data_yaml = make_corpus(work / "prepare-corpus", sample_bytes, seed=1)
    cfg = _data_config(data_yaml)
    documents = list(iter_file_documents(cfg.domains[0]))
    tokenizer = HFTokenizer.train_bpe(documents[: max(1, len(documents) // 10)], 8192)
    tokenizer.save(work / "tokenizer.json")
    raw = tokenizer._tokenizer
    start = time.perf_counter()
    bare_tokens = 0
    for i in range(0, len(documents), 2048):
        bare_tokens += sum(len(e.ids) for e in raw.encode_batch_fast(documents[i:i + 2048], add_special_tokens=False))
    bare_s = time.perf_counter() - start
    del documents
    cfg = _data_config(data_yaml, tokenizer=str(work / "tokenizer.json"))
    start = time.perf_counter()
    manifest = prepare(cfg, work / "prepare-store")
    prepare_s = time.perf_counter() - start
    tokens = sum(s["num_tokens"] for d in manifest["domains"].values() for s in d["splits"].values())
    text_bytes = sum(p.stat().st_size for p in (work / "prepare-corpus").glob("*.jsonl"))
    shutil.rmtree(work / "prepare-store")
    return {"corpus_bytes": text_bytes, "vocab_size": tokenizer.vocab_size,
            "bare_tokenizers_tokens_per_s": bare_tokens / bare_s, "prepare_tokens_per_s": tokens / prepare_s,
            "prepare_over_bare": (tokens / prepare_s) / (bare_tokens / bare_s), "prepare_s": prepare_s,
            "bare_s": bare_s, "tokens": tokens, "note": "prepare's time includes reading and hashing the sources, "
            "the eos per document, writing and hashing the shards and the manifest; bare is encode_batch_fast alone"}


STARTUP_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from moelab.config import DataConfig, from_dict, read_data_yaml
from moelab.data.mixture import build_corpus, eval_batches, sample_batch
cfg = from_dict({**read_data_yaml(sys.argv[1]), "store": sys.argv[2]}, DataConfig)
t_import = time.perf_counter()
corpus = build_corpus(cfg)
held = {d: eval_batches(corpus, d, 4, 16, 128) for d in corpus.domains}
batch = sample_batch(corpus, {"web": 1.0}, 0, 0, 16, 128)
t_ready = time.perf_counter()
start = time.perf_counter()
for step in range(1, 1001):
    sample_batch(corpus, {"web": 1.0}, 0, step, 16, 128)
sampler = 1000 / (time.perf_counter() - start)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
mb = lambda key: int(status[key].split()[0]) / 1024 if key in status else None
print(json.dumps({"data_startup_s": t_ready - t_import, "sampler_batches_per_s": sampler,
                  "peak_rss_mb": mb("VmHWM"), "rss_anon_mb": mb("RssAnon"), "rss_file_mb": mb("RssFile")}))
"""


# Peak RSS as the process's own VmHWM, printed at exit: ru_maxrss (getrusage, wait4) also counts the
# parent's pages the child shared between fork and exec, hundreds of MB here.
_WITH_PEAK = ("import atexit, sys; atexit.register(lambda: sys.stderr.write('\\nVmHWM ' + next(l for l in "
              "open('/proc/self/status') if l.startswith('VmHWM')).split(':')[1])); "
              "sys.argv = ['moelab', *sys.argv[1:]]; from moelab.cli import main; main()")


def _run(cmd: list[str]) -> tuple[str, float, float | None]:
    """Run `cmd` (a `moelab` command line); returns (stdout, wall seconds, its peak RSS in MB)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WITH_PEAK, *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"{cmd} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    peak = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("VmHWM")]
    return proc.stdout, wall, int(peak[-1]) / 1024 if peak else None


def bench_size(work: Path, total_bytes: float) -> dict:
    from moelab.data.store import open_store, prepare

    tag = f"{total_bytes / 1e6:.0f}MB"
    data_yaml = make_corpus(work / f"corpus-{tag}", total_bytes)
    start = time.perf_counter()
    manifest = prepare(_data_config(data_yaml), work / f"store-{tag}")
    prepare_s = time.perf_counter() - start
    (work / f"store-{tag}" / ".verified.json").unlink(missing_ok=True)
    start = time.perf_counter()
    open_store(work / f"store-{tag}")
    first_open_s = time.perf_counter() - start
    out = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT, str(data_yaml), str(work / f"store-{tag}")],
                         capture_output=True, text=True, check=True).stdout
    startup = json.loads(out)  # the data path alone: its peak RSS is what the corpus size could grow
    train_out = work / f"run-{tag}"
    out, wall, rss = _run(["train", "--json", "--preset", "tiny", "--data", str(data_yaml),
                           "--set", f"data.store={work / f'store-{tag}'}", "--steps", "30", "--set",
                           "train.eval_every=30", "--out", str(train_out)])
    summary = json.loads(out.strip().splitlines()[-1])
    text_bytes = sum(p.stat().st_size for p in (work / f"corpus-{tag}").glob("*.jsonl"))
    shutil.rmtree(work / f"corpus-{tag}")  # the store stays for the library comparison, the text goes
    return {"corpus_bytes": text_bytes, "store_bytes": sum(f["bytes"] for f in manifest["files"].values()),
            "tokens": sum(s["num_tokens"] for d in manifest["domains"].values() for s in d["splits"].values()),
            "prepare_s": prepare_s, "first_open_verify_s": first_open_s, **startup,
            "train_30_steps_wall_s": wall, "train_peak_rss_mb": rss,
            "train_steps_per_s": summary["tokens_per_s"] / (16 * 128) if summary.get("tokens_per_s") else None}


def bench_libraries(store_dir: Path, work: Path, num_tokens: int = 1 << 25) -> dict:
    """Random windows and a sequential scan of the same tokens in three formats."""
    import pyarrow as pa
    import tensorstore as ts

    from moelab.data.store import ShardFile, TokenStream, open_store

    train, _ = open_store(store_dir).streams(open_store(store_dir).domains[0])
    num_tokens = min(num_tokens, len(train))
    tokens = train[np.arange(num_tokens)].astype(np.uint16)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, num_tokens - WINDOW, size=(300, ROWS))
    results = {}

    np.save(work / "lib.npy", tokens)
    mm = np.load(work / "lib.npy", mmap_mode="r")

    zarr = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(work / "lib.zarr")}},
                   create=True, delete_existing=True, dtype=ts.uint16, shape=[num_tokens],
                   chunk_layout=ts.ChunkLayout(chunk_shape=[1 << 16])).result()
    zarr.write(tokens).result()
    zarr = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(work / "lib.zarr")}}).result()

    with pa.OSFile(str(work / "lib.arrow"), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("t", pa.uint16())])) as w:
        for i in range(0, num_tokens, 1 << 20):
            w.write_batch(pa.record_batch([pa.array(tokens[i:i + (1 << 20)])], names=["t"]))
    column = pa.ipc.open_file(pa.memory_map(str(work / "lib.arrow"))).read_all().column("t")

    ours = TokenStream([ShardFile(work / "lib.npy")])
    readers = {
        "moelab_tokenstream_pread_npy": lambda s: ours[s[:, None] + np.arange(WINDOW)],
        "numpy_memmap_npy": lambda s: mm[s[:, None] + np.arange(WINDOW)],
        "tensorstore_zarr": lambda s: np.stack([f.result() for f in [zarr[int(a):int(a) + WINDOW].read() for a in s]]),
        "arrow_ipc_mmap": lambda s: np.stack([column.slice(int(a), WINDOW).to_numpy() for a in s]),
    }
    scans = {
        "moelab_tokenstream_pread_npy": lambda: sum(int(ours[i:min(i + (1 << 22), num_tokens)].sum(dtype=np.int64))
                                                    for i in range(0, num_tokens, 1 << 22)),
        "numpy_memmap_npy": lambda: sum(int(mm[i:i + (1 << 22)].sum()) for i in range(0, num_tokens, 1 << 22)),
        "tensorstore_zarr": lambda: sum(int(zarr[i:min(i + (1 << 22), num_tokens)].read().result().sum())
                                        for i in range(0, num_tokens, 1 << 22)),
        "arrow_ipc_mmap": lambda: sum(int(c.to_numpy().sum()) for c in column.chunks),
    }
    for name, read in readers.items():
        assert np.array_equal(read(starts[0]), tokens[starts[0][:, None] + np.arange(WINDOW)]), name
        start = time.perf_counter()
        for s in starts:
            read(s)
        batches_per_s = len(starts) / (time.perf_counter() - start)
        start = time.perf_counter()
        total = scans[name]()
        scan_s = time.perf_counter() - start
        assert total == int(tokens.sum(dtype=np.int64)), name
        results[name] = {"random_batches_per_s": batches_per_s, "scan_tokens_per_s": num_tokens / scan_s}
    del ours
    for name in ("lib.npy", "lib.arrow"):
        (work / name).unlink()
    shutil.rmtree(work / "lib.zarr")
    return {"tokens": num_tokens, "batch": f"{ROWS} windows of {WINDOW} tokens at random offsets", **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200e6,2e9", help="corpus sizes in bytes, smallest first")
    parser.add_argument("--prepare-bytes", type=float, default=50e6, help="text for the prepare-vs-tokenizers test")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default prints it too)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="moelab-data-bench-"))
    sizes = [float(s) for s in args.sizes.split(",")]
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "prepare": bench_prepare(work, args.prepare_bytes)}
    result["sizes"] = {f"{s / 1e6:.0f}MB": bench_size(work, s) for s in sizes}
    result["libraries"] = bench_libraries(work / f"store-{sizes[0] / 1e6:.0f}MB", work)
    small, large = result["sizes"][f"{sizes[0] / 1e6:.0f}MB"], result["sizes"][f"{sizes[-1] / 1e6:.0f}MB"]
    result["checks"] = {
        "prepare_over_bare_goal_0.8": result["prepare"]["prepare_over_bare"],
        "data_startup_s_small_large": [small["data_startup_s"], large["data_startup_s"]],
        "data_peak_rss_ratio_large_over_small": large["peak_rss_mb"] / small["peak_rss_mb"],
        "sampler_headroom_over_tiny_steps": (small["sampler_batches_per_s"] / small["train_steps_per_s"]
                                             if small["train_steps_per_s"] else None),
    }
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
