"""FineWeb-Edu (or any text corpus in its shape) → SentencePiece → Megatron indexed binary shards.

    python data_prep/fineweb_edu.py --input HuggingFaceFW/fineweb-edu --name sample-100BT \\
        --output data/fwe --train-tokenizer --vocab-size 32768 --workers 16
    python data_prep/fineweb_edu.py --input data_prep/sample --output runs/fwe \\
        --tokenizer runs/fwe_tok/tokenizer.model --min-int-score 3 --language en

Output in --output: train_00000.bin/.idx, ... and valid_00000.bin/.idx, ... (each document is BOS,
its tokens, then one EOD; --no-bos drops the BOS), tokenizer.model, manifest.json. See docs/data_prep.md.
Importable: `megatron_kappa.data_prep.fineweb_edu.run(argv) -> manifest` raises DataPrepError; `main(argv) -> int`.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_kappa.data_prep import DataPrepError, sources, work
from megatron_kappa.data_prep import state as st
from megatron_kappa.data_prep.shards import ShardWriter, choose_dtype, merge
from megatron_kappa.data_prep.sources import STATUS_NAMES, Selection

VERSION = "1.0"
LAYOUTS = {True: "each document is one BOS token, its tokens, then one EOD token",
           False: "each document is its tokens followed by one EOD token; no BOS"}


def count(text: str) -> int:
    """'256M' → 268435456 (K/M/G/T are powers of 1024), plain integers as they are."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper()
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count such as 1000 or 256M, got {text!r}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = ap.add_argument_group("input")
    src.add_argument("--input", nargs="+", required=True,
                     help="hub dataset (owner/name), or parquet/jsonl files, globs or folders")
    src.add_argument("--name",
                     help="hub dataset config, e.g. sample-100BT (every paper config's budget; docs/data_prep.md)")
    src.add_argument("--split", default="train", help="hub dataset split")
    src.add_argument("--text-column", default="text")
    src.add_argument("--min-int-score", type=int, help="keep documents with int_score >= this")
    src.add_argument("--language", help="keep documents whose `language` is one of these (comma list)")
    src.add_argument("--max-docs", type=count, help="stop after this many documents (both splits)")
    src.add_argument("--max-tokens", type=count,
                     help="stop before the document that would take the total (BOS and EOD included) past this")
    tok = ap.add_argument_group("tokenizer")
    tok.add_argument("--tokenizer", help="an existing SentencePiece .model (copied into --output)")
    tok.add_argument("--train-tokenizer", action="store_true", help="train a BPE model on the input")
    tok.add_argument("--vocab-size", type=count, default=32768)
    tok.add_argument("--tokenizer-sample-docs", type=count, default=50_000,
                     help="train on the first this many kept training documents")
    out = ap.add_argument_group("output")
    out.add_argument("--output", required=True, help="output folder")
    out.add_argument("--shard-tokens", type=count, default=count("256M"),
                     help="close a shard once it holds at least this many tokens")
    out.add_argument("--valid-fraction", type=float, default=0.001,
                     help="share of documents held out for validation (chosen by a hash of the text)")
    out.add_argument("--dtype", default="auto", choices=["auto", "uint16", "int32"])
    out.add_argument("--bos", action=argparse.BooleanOptionalAction, default=True,
                     help="start every document with BOS, as nanochat's training data and CORE "
                          "prompts do (recorded in manifest.json as \"bos\")")
    out.add_argument("--seed", type=int, default=1234, help="seeds the train/valid split")
    out.add_argument("--overwrite", action="store_true", help="delete this tool's files in --output first")
    run = ap.add_argument_group("run (do not change the output)")
    run.add_argument("--workers", type=int, default=os.cpu_count())
    run.add_argument("--jsonl-unit-bytes", type=count, default=count("4M"),
                     help="jsonl work unit size (parquet units are row groups)")
    run.add_argument("--hub-unit-docs", type=count, default=1024, help="hub work unit size")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if bool(args.tokenizer) == bool(args.train_tokenizer):
        ap.error("give exactly one of --tokenizer FILE and --train-tokenizer")
    if not 0 <= args.valid_fraction < 1:
        ap.error("--valid-fraction must be in [0, 1)")
    if args.workers < 1 or args.shard_tokens < 1:
        ap.error("--workers and --shard-tokens must be positive")
    return args


def open_source(args, selection: Selection) -> dict:
    """Checks every input up front; returns the source description and a unit factory."""
    columns = selection.columns()
    if len(args.input) == 1 and sources.is_hub_name(args.input[0]):
        ds = sources.open_hub(args.input[0], args.name, args.split, columns)
        return {"desc": {"hub": args.input[0], "config": args.name, "split": args.split},
                "units": lambda skip=0: sources.hub_units(ds, columns, args.hub_unit_docs, skip),
                "rows": None}
    files = [sources.check_file(p, columns) for p in sources.resolve_files(args.input)]
    units = sources.local_units(files, args.jsonl_unit_bytes)
    rows = sum(sum(f["rows"]) for f in files) if all("rows" in f for f in files) else None
    return {"desc": {"files": [{"path": f["path"], "bytes": f["bytes"]} for f in files]},
            "units": lambda skip=0: iter(units[skip:]), "rows": rows}


def load_tokenizer(path: str):
    from megatron_kappa.tokenizer import Tokenizer
    try:
        return Tokenizer(path)
    except Exception as e:
        raise DataPrepError(f"{path}: cannot load as a SentencePiece model ({sources._short(e)})") from None


def tokenizer_sample(source: dict, selection: Selection, args) -> list[str]:
    """The first --tokenizer-sample-docs kept documents of the training split, in input order."""
    key, want, texts = work.split_key(args.seed), args.tokenizer_sample_docs, []
    if args.max_docs:
        want = min(want, args.max_docs)
    for unit in source["units"]():
        batch = unit[1] if unit[0] == "hub" else sources.read_unit(unit, selection.columns())
        status = selection.status(batch)
        kept = [t for t, s in zip(batch[selection.text], status) if s == sources.KEPT]
        held_out = work.valid_flags(kept, key, args.valid_fraction)
        texts += [t for t, v in zip(kept, held_out) if not v]
        if len(texts) >= want:
            return texts[:want]
    return texts


class Writer:
    """Consumes unit results in order: shards, validation pieces, limits, checkpoints."""

    def __init__(self, out: Path, state: dict, dtype: np.dtype, args):
        self.out, self.state, self.dtype = out, state, dtype
        self.shard_tokens, self.max_docs, self.max_tokens = args.shard_tokens, args.max_docs, args.max_tokens
        last = state["checkpoints"][-1] if state["checkpoints"] else None
        self.totals = dict(last["totals"]) if last else {
            "rows_read": 0, "dropped": {name: 0 for name in STATUS_NAMES.values()},
            "train": {"documents": 0, "tokens": 0}, "valid": {"documents": 0, "tokens": 0}}
        self.totals = _copy(self.totals)
        self.unit, self.row = last["next"] if last else (0, 0)
        self.train = self.valid = None
        self.started, self.new_tokens, self.new_docs = time.time(), 0, 0

    def _count_rows(self, status: np.ndarray, start: int, stop: int) -> None:
        counts = np.bincount(status[start:stop], minlength=len(STATUS_NAMES) + 1)
        self.totals["rows_read"] += stop - start
        for code, name in STATUS_NAMES.items():
            self.totals["dropped"][name] += int(counts[code])

    def consume(self, u: int, res: dict) -> bool:
        """Add one unit's documents; False once a --max-docs/--max-tokens limit stops the run.

        Runs of consecutive training documents are written with one call each; a run ends at a
        validation document or at the document that fills the shard (then a checkpoint)."""
        rows, lengths, tokens, valid = res["rows"], res["lengths"], res["tokens"], res["valid"]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        first = int(np.searchsorted(rows, self.row if u == self.unit else 0))
        counted = self.row if u == self.unit else 0
        stop, limit = self._limit(lengths, first)
        stop_row = None  # the row where a limit stops the run, if it does in this unit
        if limit == "docs":
            stop_row = int(rows[stop - 1]) + 1 if stop > first else counted
        elif limit == "tokens":
            stop_row = int(rows[stop])
        held_out = iter(np.flatnonzero(valid[first:stop]) + first)
        i, v = first, next(held_out, stop)
        while i < stop:
            if i == v:  # a validation document
                self._shard("valid").add(tokens[offsets[i]:offsets[i + 1]])
                self._count_docs("valid", lengths[i:i + 1])
                i, v = i + 1, next(held_out, stop)
                continue
            train = self._shard("train")
            need = self.shard_tokens - train.tokens
            fill = int(np.searchsorted(np.cumsum(lengths[i:v]), need))  # doc that fills the shard
            j = min(v, i + fill + 1)
            train.add_many(tokens[offsets[i]:offsets[j]], lengths[i:j])
            self._count_docs("train", lengths[i:j])
            i = j
            if train.tokens >= self.shard_tokens:
                self._count_rows(res["status"], counted, int(rows[i - 1]) + 1)
                counted = int(rows[i - 1]) + 1
                self.checkpoint((u, counted))
        if stop_row is not None:  # a limit was reached inside this unit
            self._count_rows(res["status"], counted, stop_row)
            self.checkpoint((u, stop_row), done=True)
            return False
        self._count_rows(res["status"], counted, len(res["status"]))
        self.unit, self.row = u + 1, 0
        return True

    def _limit(self, lengths: np.ndarray, first: int) -> tuple[int, str | None]:
        """(end of the documents to take from this unit, which limit stops the run there or None).
        --max-docs stops right after the last document allowed; --max-tokens stops before the
        first document that would not fit."""
        stop, cut = len(lengths), None
        done_docs = self.totals["train"]["documents"] + self.totals["valid"]["documents"]
        done_tokens = self.totals["train"]["tokens"] + self.totals["valid"]["tokens"]
        if self.max_tokens is not None:
            fits = int(np.searchsorted(done_tokens + np.cumsum(lengths[first:]), self.max_tokens,
                                       side="right"))
            if first + fits < stop:
                stop, cut = first + fits, "tokens"
        if self.max_docs is not None and first + self.max_docs - done_docs <= stop:
            stop, cut = max(first, first + self.max_docs - done_docs), "docs"
        return stop, cut

    def _count_docs(self, split: str, lengths: np.ndarray) -> None:
        self.totals[split]["documents"] += len(lengths)
        self.totals[split]["tokens"] += int(lengths.sum())
        self.new_docs += len(lengths)
        self.new_tokens += int(lengths.sum())

    def _shard(self, split: str) -> ShardWriter:
        if split == "train":
            if self.train is None:
                n = sum(1 for c in self.state["checkpoints"] if c["train"])
                self.train = ShardWriter(self.out / f"train_{n:05d}", self.dtype)
            return self.train
        if self.valid is None:
            k = len(self.state["checkpoints"])
            self.valid = ShardWriter(self.out / st.STATE_DIR / f"valid_{k:05d}", self.dtype)
        return self.valid

    def checkpoint(self, next_pos: tuple[int, int], done: bool = False) -> None:
        """Finish the open train shard and validation piece, then record them (atomically)."""
        record = {"train": self.train.close() if self.train else None,
                  "valid": self.valid.close() if self.valid else None,
                  "next": list(next_pos), "totals": _copy(self.totals)}
        self.train = self.valid = None
        self.state["checkpoints"].append(record)
        self.state["done"] = done
        st.save(self.out, self.state)

    def abort(self) -> None:
        for shard in (self.train, self.valid):
            if shard is not None:
                shard.abort()


def _copy(totals: dict) -> dict:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in totals.items()}


class _Lines:
    """A stream for tqdm that is not a terminal (a log file, a pipe): each refresh becomes its own
    line, not one carriage-return-separated line of every refresh."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str):
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self):
        self.stream.flush()


LOG_INTERVAL = 30.0  # seconds between progress lines in a log


def progress(total: int, initial: int, quiet: bool, stream=None, interval: float = LOG_INTERVAL):
    """The docs-read progress: tqdm's bar on a terminal; in a log, a plain line every `interval`
    seconds and a last one at the end."""
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        return tqdm(total=total, initial=initial, unit="doc", unit_scale=True, desc="docs read", disable=quiet,
                    dynamic_ncols=True, file=stream)
    return tqdm(total=total, initial=initial, unit="doc", unit_scale=True, desc="docs read", disable=quiet,
                file=_Lines(stream), mininterval=interval, maxinterval=float("inf"), miniters=1,
                bar_format="{desc}: {n_fmt}/{total_fmt} ({percentage:.0f} %), {elapsed} elapsed, "
                           "{remaining} left{postfix}")


def tokenize(out: Path, state: dict, source: dict, tok_file: Path, selection: Selection, dtype, args):
    """Run the workers over the units left and write shards in input order as results arrive."""
    writer = Writer(out, state, dtype, args)
    init_args = (str(tok_file), selection, dtype.name, args.seed, args.valid_fraction, args.bos)
    bar = progress(source["rows"], writer.totals["rows_read"], args.quiet)
    pool = None
    try:
        if args.workers > 1:
            # concurrent.futures, not multiprocessing.Pool: Pool.terminate() after a worker's error
            # can hang for good (its task thread blocked writing to a pipe no worker reads any more);
            # shutdown(cancel_futures=True) drops the queued units and lets the running ones end.
            pool = ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn"),
                                       initializer=work.init, initargs=init_args)
            def submit(unit):
                return _submit_deferring_ctrl_c(pool, unit)
        else:
            work.init(*init_args)
            def submit(unit):
                return _Done(work.process(unit))
        window: deque = deque()
        units = enumerate(source["units"](writer.unit), start=writer.unit)
        going = True
        while going:
            for u, unit in units:  # keep at most 2 units per worker in flight: bounded memory
                window.append((u, submit(unit)))
                if len(window) >= 2 * args.workers:
                    break
            if not window:
                break
            u, pending = window.popleft()
            res = pending.result()
            going = writer.consume(u, res)
            bar.update(len(res["status"]))
            elapsed = max(time.time() - writer.started, 1e-9)
            bar.set_postfix_str(f"{writer.new_docs / elapsed:,.0f} docs/s written, "
                                f"{writer.new_tokens / elapsed:,.0f} tok/s", refresh=False)
        if going:
            writer.checkpoint((writer.unit, 0), done=True)
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _submit_deferring_ctrl_c(pool, unit):
    """pool.submit, with SIGINT blocked meanwhile: the workers are started inside submit (spawn: a
    fresh interpreter each), and a blocked signal stays blocked across exec, so a Ctrl-C during
    their start-up waits there until work.init ignores it (not a traceback in each of them).
    Here it waits too, and arrives when submit returns: blocked, not ignored, so a Ctrl-C that
    lands in this window is not lost (CPython's executor starts a worker only when none is idle,
    so with a fast worker every submit can be such a window). Once all workers are started
    (`_processes`), submit is left alone."""
    if len(getattr(pool, "_processes", None) or ()) >= pool._max_workers:  # all started: Ctrl-C is ours
        return pool.submit(work.process, unit)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return pool.submit(work.process, unit)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class _Done:
    """A finished result, read like a future's (one process, no pool)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def finish(out: Path, state: dict, config: dict, tokenizer: dict, dtype, args) -> dict:
    """Merge the validation pieces, write manifest.json (atomically), drop the progress folder."""
    cps = state["checkpoints"]
    pieces = [out / st.STATE_DIR / c["valid"]["prefix"] for c in cps if c["valid"]]
    valid = merge(pieces, out, "valid", dtype, args.shard_tokens)
    train = [c["train"] for c in cps if c["train"]]
    totals = _copy(cps[-1]["totals"])
    if not totals["train"]["documents"] and not totals["valid"]["documents"]:
        raise DataPrepError(f"no documents left after the filters ({totals['rows_read']:,} rows read); "
                            "no shards written (check --text-column, --language, --min-int-score)")
    for split, entries in (("train", train), ("valid", valid)):
        totals[split]["shards"] = len(entries)
        for e in entries:
            e["split"] = split
    manifest = {"tool": "data_prep/fineweb_edu.py", "version": VERSION, "config": config,
                "source": config["source"], "filters": config["filters"], "seed": args.seed,
                "tokenizer": tokenizer, "dtype": dtype.name, "bos": args.bos, "layout": LAYOUTS[args.bos],
                "shards": train + valid, "totals": totals,
                "prefixes": {"train": [e["prefix"] for e in train],
                             "valid": [e["prefix"] for e in valid]}}
    st.write_json(out / "manifest.json", manifest)
    shutil.rmtree(out / st.STATE_DIR)
    return manifest


def run(argv=None) -> dict:
    """The whole job; returns the manifest. Every input problem is a DataPrepError, raised early."""
    args = parse_args(argv)
    out = Path(args.output)
    languages = tuple(x.strip() for x in args.language.split(",")) if args.language else None
    selection = Selection(text=args.text_column, min_int_score=args.min_int_score, languages=languages)
    source = open_source(args, selection)
    if args.tokenizer:
        given = load_tokenizer(args.tokenizer)
        vocab, tok_config = given.vocab_size, {"sha256": given.sha256()}
    else:
        vocab = args.vocab_size
        tok_config = {"train": {"vocab_size": vocab, "sample_docs": args.tokenizer_sample_docs}}
    dtype = choose_dtype(vocab, args.dtype)
    config = {"source": source["desc"], "tokenizer": tok_config, "dtype": dtype.name,
              "filters": {"text_column": args.text_column, "min_int_score": args.min_int_score,
                          "language": list(languages) if languages else None,
                          "max_docs": args.max_docs, "max_tokens": args.max_tokens},
              "shard_tokens": args.shard_tokens, "valid_fraction": args.valid_fraction,
              "seed": args.seed, "bos": args.bos, "version": VERSION}
    run_settings = {"jsonl_unit_bytes": args.jsonl_unit_bytes, "hub_unit_docs": args.hub_unit_docs}
    state, done = st.open_output(out, config, run_settings, args.overwrite)
    if done is not None:
        print(f"{out}: already complete (manifest.json); nothing to do", file=sys.stderr)
        return done
    st.clean_unrecorded(out, state)
    for folder, split in ((out, "train"), (out / st.STATE_DIR, "valid")):
        st.check_finished(folder, [c[split] for c in state["checkpoints"] if c[split]])

    tok_file = out / "tokenizer.model"
    if not tok_file.exists():
        if args.tokenizer:
            shutil.copyfile(args.tokenizer, out / "tokenizer.model.tmp")
            os.replace(out / "tokenizer.model.tmp", tok_file)
        else:
            from megatron_kappa.tokenizer import train_tokenizer
            texts = tokenizer_sample(source, selection, args)
            if not texts:
                raise DataPrepError("no documents left after filtering to train the tokenizer on")
            print(f"training a {vocab}-piece tokenizer on {len(texts):,} documents "
                  f"({sum(map(len, texts)):,} characters)", file=sys.stderr)
            try:
                train_tokenizer(texts, tok_file, vocab, num_threads=args.workers)
            except RuntimeError as e:  # SentencePiece's complaints, e.g. a vocabulary too large
                raise DataPrepError(f"tokenizer training failed: {sources._short(e)}") from None
    tok = load_tokenizer(str(tok_file))
    if state["tokenizer_sha256"] not in (None, tok.sha256()) or (
            args.tokenizer and tok.sha256() != tok_config["sha256"]):
        raise DataPrepError(f"{tok_file}: differs from the tokenizer this run's shards were made with; "
                            "use --overwrite")
    if state["tokenizer_sha256"] is None:
        state["tokenizer_sha256"] = tok.sha256()
        st.save(out, state)

    if not state["done"]:
        tokenize(out, state, source, tok_file, selection, dtype, args)
    tokenizer = {"file": tok_file.name, "sha256": tok.sha256(), "vocab_size": tok.vocab_size,
                 "bos": tok.bos, "eod": tok.eod, "pad": tok.pad,
                 "source": args.tokenizer or "trained by this run"}
    manifest = finish(out, state, config, tokenizer, dtype, args)
    t = manifest["totals"]
    print(f"{out}: {t['train']['shards']} train shards ({t['train']['documents']:,} documents, "
          f"{t['train']['tokens']:,} tokens), {t['valid']['shards']} valid shards "
          f"({t['valid']['documents']:,} documents, {t['valid']['tokens']:,} tokens)", file=sys.stderr)
    return manifest


class Terminated(BaseException):
    """SIGTERM, raised in the main process: the pool is shut down and the finished shards kept, as
    on Ctrl-C (it died at once: exit 143 without a word, and the resource tracker then warned of
    the pool's leaked semaphores)."""


def _terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not break the clean-up
    raise Terminated


def main(argv=None) -> int:
    import threading
    from concurrent.futures.process import BrokenProcessPool
    ours = threading.current_thread() is threading.main_thread()  # signal.signal needs the main thread
    previous = signal.signal(signal.SIGTERM, _terminated) if ours else None
    try:
        run(argv)
    except DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, an I/O error: the finished shards stay, and the run resumes
        from megatron_kappa.checkpoint.listing import write_failure
        out = os.path.abspath(parse_args(argv).output)  # run() got past parsing them
        where = os.path.abspath(e.filename) if isinstance(e.filename, str) else None
        if where and os.path.commonpath([where, out]) != out:  # not a write of ours: an input, say
            print(f"error: {where}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"error: writing {where or 'into ' + out}: {write_failure(e, out)}; "
              "the finished shards are kept and the same command resumes", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the finished shards are kept; the same command resumes", file=sys.stderr)
        return 130
    except (Terminated, BrokenProcessPool) as e:
        # SIGTERM to the whole group can end a worker before this process hears its own
        if not isinstance(e, Terminated) and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            raise
        print("terminated (SIGTERM): the finished shards are kept; the same command resumes", file=sys.stderr)
        return 143
    finally:
        if ours:
            signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
