"""The tokenization job (`elastic-gpt prepare-data`, `python -m data_pipelines prepare`): raw text
in any fsspec storage -> fixed-length token shards.

The job is a Ray Data pipeline over *parts*: the sorted input files cut into consecutive groups of
about `part_bytes` of raw input (sources.py). Each part becomes exactly one shard (tokens of its
documents, an end-of-text after each document, packed into records of seq_len + 1 tokens, the
last record padded with end-of-text; tokenize_part.py, shards.py). A shard is therefore a pure
function of its part's files and the options:

- output is byte-identical for the same input, whatever the number of workers or their timing;
- parts are independent, so tokenization is embarrassingly parallel (`map_batches` over Ray
  tasks, one tokenizer per worker process; engines.py);
- each shard is committed by a small `.done.json` marker written after it, so a re-run after an
  interruption redoes only the parts without a valid marker. `manifest.json` is written last
  (output.py; C4 atomic commit).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

from data_pipelines.engines import ENGINES, Progress, choose_engine, run_parts_local, run_parts_ray
from data_pipelines.output import (
    check_output,
    check_output_writable,
    output_has_entries,
    remove_output,
    write_manifest,
)
from data_pipelines.shards import part_key, read_marker
from data_pipelines.sources import BAD_UTF8_POLICIES, DocStats, group_into_parts, list_inputs
from data_pipelines.split import validation_threshold_for_docs
from elastic_gpt.data.manifest import VALIDATION_DIR, validation_url
from elastic_gpt.data.tokenizers import get_tokenizer, token_dtype

log = logging.getLogger(__name__)


def prepare_data(input: str | list[str], output: str, tokenizer: str = "gpt2",
                 seq_len: int = 1024, *, storage_options: dict | None = None,
                 progress: bool = True, text_field: str = "text", bad_utf8: str = "replace",
                 max_files: int | None = None, max_bytes: int | None = None,
                 part_bytes: int | None = None, engine: str = "auto",
                 num_workers: int | None = None, overwrite: bool = False,
                 val_fraction: float = 0.0, val_docs: int = 0, val_seed: int = 0,
                 val_input: str | list[str] | None = None, allow_binary: bool = False) -> dict:
    """Tokenize `input` (URL, glob, directory, or a list of them) into a dataset at `output`.

    A validation set goes to `output/val` (a dataset of its own, same tokenizer and seq_len):
    `val_fraction` holds out about that share of the documents, whole, chosen by a seeded hash
    of their text (`in_validation_split`), and the training shards do not contain them;
    `val_docs` holds out exactly that many (the smallest hashes: one more reading pass over the
    input); or `val_input` names separate validation files. Returns the summary dict (also stored in the
    manifest's `stats`); ValueError names what is wrong and how to fix it (C6 clear errors)."""
    t0 = time.perf_counter()
    if seq_len < 1:
        raise ValueError(f"--seq-len must be positive, got {seq_len}")
    if bad_utf8 not in BAD_UTF8_POLICIES:
        raise ValueError(f"--bad-utf8 must be one of {BAD_UTF8_POLICIES}, got {bad_utf8!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}; e.g. "
                         "--val-fraction 0.05 holds out 5% of the documents")
    if val_docs < 0:
        raise ValueError(f"--val-docs must be at least 0, got {val_docs}")
    if sum(bool(x) for x in (val_fraction, val_docs, val_input)) > 1:
        raise ValueError("--val-fraction, --val-docs and --val-input each name a validation "
                         "set; keep one")
    if tokenizer.endswith(".json") and "://" not in tokenizer:
        tokenizer = os.path.abspath(tokenizer)  # Ray workers may run in another directory
    tok = get_tokenizer(tokenizer)
    output = output.rstrip("/")
    if "://" not in output:
        output = os.path.abspath(output)
    options = {"tokenizer": tokenizer, "seq_len": seq_len, "dtype": token_dtype(tok.vocab_size),
               "text_field": text_field, "bad_utf8": bad_utf8, "format_version": 1}
    if hasattr(tok, "to_str"):  # a tokenizer.json: its contents, not its path, decide the tokens
        options["tokenizer_sha256"] = hashlib.sha256(tok.to_str().encode()).hexdigest()
    files = list_inputs(input, storage_options, max_files, max_bytes)
    if val_docs:
        threshold = validation_threshold_for_docs(
            files, val_docs, val_seed, {**options, "allow_binary": allow_binary},
            storage_options)
    else:
        threshold = int(val_fraction * 2 ** 64)
    split = bool(val_fraction or val_docs)
    if split:  # only then: the keys (and so the reuse) of datasets without a split stay
        options.update(val_threshold=threshold, val_seed=int(val_seed))
    parts = group_into_parts(files, part_bytes)
    keys = [part_key(p, options) for p in parts]
    job_key = hashlib.sha256("".join(keys).encode()).hexdigest()
    fresh = not output_has_entries(output, storage_options)
    check_output_writable(output, storage_options)
    check_output(output, job_key, storage_options, overwrite)
    options["allow_binary"] = allow_binary

    markers: dict[int, dict] = {}
    for i, key in enumerate(keys):
        m = read_marker(output, i, key, storage_options)
        if m is not None:
            markers[i] = m
    todo = [(i, parts[i]) for i in range(len(parts)) if i not in markers]
    engine = choose_engine(engine, sum(f.size for _, p in todo for f in p))
    bar = Progress(sum(f.size for i, p in todo for f in p), progress)
    errors: list[str] = []

    def on_done(index, part_files, result):
        if "error" in result:
            errors.append(result["error"])
            return
        markers[index] = result
        bar.update(result["stats"], sum(f.size for f in part_files))

    try:
        if todo:
            if engine == "local":
                run_parts_local(todo, output, options, storage_options, on_done, bar)
            else:
                run_parts_ray(todo, output, options, storage_options, on_done, num_workers, bar)
    finally:
        bar.close()
    if errors:
        # Committed parts stay: a re-run after fixing the input redoes only the failed ones. A
        # new output that got no committed part is removed: a refused input leaves nothing.
        if fresh and not markers:
            remove_output(output, storage_options)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ValueError(errors[0] + more)

    source = {"input": input if isinstance(input, str) else list(input), "files": len(files),
              "bytes": sum(f.size for f in files), "job_key": job_key,
              "text_field": text_field, "bad_utf8": bad_utf8}
    if split:
        val_markers = {i: m["val"] for i, m in markers.items()}
        val_summary = write_manifest(
            validation_url(output), tokenizer, tok, options, len(parts), val_markers,
            {**source, "split": "validation", "of": output, "val_fraction": val_fraction,
             "val_docs": val_docs, "val_seed": val_seed}, storage_options,
            empty_hint=f"--val-fraction {val_fraction} held out none of the {len(files)} "
                       "files' documents (documents are held out whole); raise "
                       "--val-fraction, or hold out an exact number with --val-docs N")
    summary = write_manifest(
        output, tokenizer, tok, options, len(parts), markers,
        {**source, "split": "train"} if split else source, storage_options,
        empty_hint=_empty_corpus_hint(input, files, markers, options, split))
    summary.update(parts_reused=len(parts) - len(todo), parts_built=len(todo),
                   tokenize_seconds=round(bar.seconds if todo else 0.0, 3),
                   tokenized_bytes=bar.bytes, engine=engine, output=output)
    if split:
        summary["val"] = val_summary
    if val_input:
        summary["val"] = prepare_data(
            val_input, validation_url(output), tokenizer, seq_len,
            storage_options=storage_options, progress=progress, text_field=text_field,
            bad_utf8=bad_utf8, part_bytes=part_bytes, engine=engine, num_workers=num_workers,
            overwrite=overwrite, allow_binary=allow_binary)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    _warn_if_seq_len_exceeds_documents(seq_len, summary)
    return summary


def _warn_if_seq_len_exceeds_documents(seq_len: int, summary: dict) -> None:
    longest = summary.get("longest_doc_tokens", 0)
    if longest and seq_len > longest:
        log.warning("--seq-len %d is longer than the longest document (%d tokens): every sample "
                    "spans several documents%s; a --seq-len near the documents' length trains "
                    "on whole documents", seq_len, longest,
                    " and most of it is end-of-text padding"
                    if summary["tokens"] < seq_len else "")


def _empty_corpus_hint(input, files, markers, options, split: bool) -> str:
    totals = DocStats().as_dict()
    for m in markers.values():
        DocStats.merge(totals, m["stats"])
    if totals["docs"] == 0 and split and any(m["val"]["stats"]["docs"]
                                                    for m in markers.values()):
        return (f"every document of {input} fell in the validation split; lower "
                "--val-fraction or --val-docs")
    hint = ""
    if totals["bad_records"]:
        hint = (f"; {totals['bad_records']} records had no string field "
                f"{options['text_field']!r} (pass --text-field NAME)")
    elif totals["skipped_docs"]:
        hint = f"; {totals['skipped_docs']} documents were skipped as non-UTF-8"
    return (f"the corpus {input} has no text ({len(files)} files, "
            f"{sum(f.size for f in files)} bytes){hint}")


def format_summary(s: dict) -> str:
    """The job's summary as the lines `prepare` prints."""
    mb = s["input_bytes"] / 1e6
    rate = s["tokenized_bytes"] / 1e6 / s["tokenize_seconds"] if s.get("tokenize_seconds") else 0.0
    work = (f"tokenizing ({s['engine']}) {s['tokenize_seconds']:.1f} s at {rate:.1f} MB/s; "
            f"{s['parts_built']} shards built, {s['parts_reused']} reused") if s["parts_built"] \
        else "every shard was already committed, nothing to tokenize"
    lines = [
        f"prepared {s['output']}: {s['files']:,} files ({mb:.1f} MB) -> {s['docs']:,} documents, "
        f"{s['tokens']:,} tokens, {s['samples']:,} samples in {s['shards']} shards "
        f"({s['seconds']:.1f} s; {work})",
    ]
    skips = {k: s[k] for k in ("bad_utf8_docs", "bad_utf8_bytes", "skipped_docs", "bad_records",
                               "empty_docs", "split_docs") if s.get(k)}
    if skips:
        lines.append("  counted: " + ", ".join(f"{k}={v:,}" for k, v in skips.items()))
    if s.get("text_bytes"):
        lines.append(f"  {s['text_bytes'] / max(1, s['tokens']):.2f} bytes of text per token")
    val = s.get("val")
    if val:
        lines.append(f"  validation split {s['output']}/{VALIDATION_DIR}: {val['docs']:,} "
                     f"documents, {val['tokens']:,} tokens, {val['samples']:,} samples in "
                     f"{val['shards']} shards")
    return "\n".join(lines)
