"""``chatgrammar mask`` — a dataset file in, token ids and loss masks out.

::

    chatgrammar mask -f kimi-k2 --tokenizer ./tok data.jsonl masked.parquet -j 4

IN is JSONL (``.jsonl`` / ``.json`` / ``.ndjson``) or Parquet (``.parquet``). Each row has either
``messages`` (rendered with ``--template FILE`` or the tokenizer's chat template, exactly as
transformers renders it, see :mod:`chatgrammar.conformance.render`; a row's ``tools`` are passed along) or
``input_ids``. OUT (JSONL or Parquet, by extension) gets, per accepted row in input order,
``row`` (the input row number), ``input_ids``, ``loss_mask`` and ``num_trained``.

Rows are streamed in chunks (memory stays constant whatever the file size); ``-j N`` runs N
worker processes, each loading the format (from the compile cache) and the tokenizer itself.
A row that cannot be rendered, tokenised or parsed is never dropped silently and never given an
empty mask: it is counted and written to the rejects file (``OUT.rejects.jsonl`` unless
``--rejects``) with its row number and the error. A summary ends the run (samples, tokens,
trained fraction, rejects, turns per role).

Exit codes: 0 every row masked; 1 some rows were rejected (the output holds the others);
2 usage error (bad arguments, missing file, tokenizer that cannot be loaded).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import ChatGrammarError
from ._common import (UsageError, add_command, add_policy_args, add_tokenizer_args, key_values,
                      policy_changes, policy_for, read_template, tokenizer_arg)

JSONL_EXT = (".jsonl", ".json", ".ndjson")
PARQUET_EXT = (".parquet", ".pq")


def register(subparsers: Any) -> None:
    """Add ``chatgrammar mask`` (see the module docstring)."""
    p = add_command(subparsers, run, __doc__)
    p.add_argument("input", metavar="IN", help="input .jsonl or .parquet (rows with `messages` "
                                               "or `input_ids`)")
    p.add_argument("output", metavar="OUT", help="output .jsonl or .parquet")
    p.add_argument("-f", "--format", default="auto",
                   help="format name or spec path; `auto` (default) detects it from the "
                        "tokenizer")
    add_tokenizer_args(p, required=True)
    p.add_argument("--template", metavar="FILE",
                   help="Jinja chat template for `messages` rows (default: the tokenizer's)")
    p.add_argument("--template-kwarg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra template variable (VALUE parsed as JSON, else a string); "
                        "repeatable, e.g. --template-kwarg enable_thinking=false")
    p.add_argument("-j", "--jobs", type=int, default=1, metavar="N",
                   help="worker processes (default 1: in this process)")
    p.add_argument("--chunk-size", type=int, default=256, metavar="ROWS",
                   help="rows per work unit (default 256)")
    p.add_argument("--rejects", metavar="FILE",
                   help="where rejected rows go (default: OUT.rejects.jsonl)")
    p.add_argument("--summary", metavar="FILE", help="also write the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_policy_args(p)
    g = p.add_argument_group("parsing")
    g.add_argument("--lenient", action="store_true",
                   help="skip malformed parts instead of rejecting the row")


def _template_kwargs(pairs: list[str]) -> dict:
    return key_values(pairs, "--template-kwarg")


# ----------------------------------------------------------------------------- input / output

def _kind(path: str, what: str) -> str:
    low = path.lower()
    if low.endswith(JSONL_EXT):
        return "jsonl"
    if low.endswith(PARQUET_EXT):
        return "parquet"
    raise UsageError(f"{what} {path!r}: expected a .jsonl or .parquet file")


def count_rows(path: str) -> int | None:
    """Rows in a dataset file (Parquet: from its metadata; JSONL: non-blank lines)."""
    if _kind(path, "IN") == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    n = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                n += 1
    return n


def iter_chunks(path: str, size: int) -> Iterator[list[tuple[int, Any]]]:
    """``(row number, row dict | error str)`` in chunks of ``size``, streamed."""
    chunk: list = []
    row = 0
    if _kind(path, "IN") == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        cols = [c for c in ("messages", "input_ids", "tools") if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(batch_size=size, columns=cols or None):
            ids_chunk = _ids_columns(batch, row)
            if ids_chunk is not None:  # token ids only: stay columnar (no Python lists)
                if chunk:
                    yield chunk
                    chunk = []
                yield ids_chunk
                row += batch.num_rows
                continue
            for rec in batch.to_pylist():
                chunk.append((row, rec))
                row += 1
                if len(chunk) >= size:
                    yield chunk
                    chunk = []
    else:
        with open(path, "r", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    rec = f"invalid JSON: {exc}"
                chunk.append((row, rec))
                row += 1
                if len(chunk) >= size:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def _ids_columns(batch, row0: int):
    """A Parquet batch whose rows all carry ``input_ids`` (and no messages) as
    ``("ids", first row, offsets, values)`` numpy arrays, else None."""
    import numpy as np
    import pyarrow as pa

    names = batch.schema.names
    if "input_ids" not in names:
        return None
    if "messages" in names and batch.column(names.index("messages")).null_count < batch.num_rows:
        return None
    col = batch.column(names.index("input_ids"))
    if col.null_count or not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
        return None
    if not pa.types.is_integer(col.type.value_type):
        return None
    offsets = col.offsets.to_numpy().astype(np.int64)
    values = col.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    if col.values.null_count:
        return None
    return ("ids", row0, offsets - offsets[0], values.astype(np.int64, copy=False))


class _Columns:
    """Accepted rows of a columnar chunk: row numbers, ids and masks as flat arrays."""

    def __init__(self, rows, offsets, ids, mask, num_trained):
        self.rows, self.offsets, self.ids, self.mask = rows, offsets, ids, mask
        self.num_trained = num_trained

    def __len__(self) -> int:
        return len(self.rows)

    def to_rows(self) -> list[dict]:
        o = self.offsets.tolist()
        ids, mask = self.ids.tolist(), self.mask.tolist()
        return [{"row": r, "input_ids": ids[o[k]:o[k + 1]], "loss_mask": mask[o[k]:o[k + 1]],
                 "num_trained": n}
                for k, (r, n) in enumerate(zip(self.rows.tolist(), self.num_trained.tolist()))]


class _Writer:
    def __init__(self, path: str):
        self.kind = _kind(path, "OUT")
        self.path = path
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if self.kind == "jsonl":
            self.f = open(path, "w", encoding="utf-8")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            self.schema = pa.schema([("row", pa.int64()), ("input_ids", pa.list_(pa.int64())),
                                     ("loss_mask", pa.list_(pa.int8())),
                                     ("num_trained", pa.int64())])
            self.w = pq.ParquetWriter(path, self.schema)

    def write(self, rows) -> None:
        if not len(rows):
            return
        if isinstance(rows, _Columns):
            if self.kind == "jsonl":
                rows = rows.to_rows()
            else:
                import pyarrow as pa

                off = pa.array(rows.offsets.astype("int32"))
                self.w.write_table(pa.Table.from_arrays(
                    [pa.array(rows.rows), pa.ListArray.from_arrays(off, pa.array(rows.ids)),
                     pa.ListArray.from_arrays(off, pa.array(rows.mask.astype("int8"))),
                     pa.array(rows.num_trained)], schema=self.schema))
                return
        if self.kind == "jsonl":
            self.f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
        else:
            import pyarrow as pa

            self.w.write_table(pa.Table.from_pylist(rows, schema=self.schema))

    def close(self) -> None:
        if self.kind == "jsonl":
            self.f.close()
        else:
            self.w.close()


# ----------------------------------------------------------------------------- work

_STATE: dict = {}


def _init(cfg: dict, tok: Any = None) -> None:
    """Per-process setup: format (compile cache) and tokenizer loaded here, never pickled
    (``tok``: the tokenizer this process already loaded from ``cfg["tokenizer"]``, ``-j 1``)."""
    import chatgrammar as cg
    from ..conformance.render import special_token_vars

    if tok is None:  # a worker process: load it, then give back what loading freed
        tok = tokenizer_arg(cfg["tokenizer"], cfg["trust_remote_code"])
        _return_freed_memory()
    if cfg.get("spec_yaml"):  # an inferred format: rebuilt from its YAML in each process
        from ..conformance.infer import _from_yaml
        fmt = _from_yaml(cfg["spec_yaml"])
    else:
        fmt = cg.load_format(cfg["format"])
    policy = fmt.default_policy.replace(**cfg["policy"]) if cfg["policy"] else fmt.default_policy
    template = cfg["template"]
    if template is None:
        t = getattr(tok, "chat_template", None)
        template = t.get("default") if isinstance(t, dict) else t
    specials = special_token_vars(tok)
    _STATE.update(fmt=fmt, tok=tok, policy=policy, template=template,
                  render_kwargs={**specials, **cfg["template_kwargs"]},
                  strict=cfg["strict"])


def _return_freed_memory() -> None:
    """Give the heap that loading a tokenizer freed back to the system (transformers parses
    tokenizer.json in Python besides the Rust parse: a Qwen-sized vocabulary leaves ~150 MB
    freed but mapped in each worker otherwise). glibc only; elsewhere a no-op."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _ids_of(rec: Any) -> list[int]:
    if not isinstance(rec, dict):
        raise ValueError(rec if isinstance(rec, str) else "row is not an object")
    ids = rec.get("input_ids")
    if ids is not None:
        ids = list(ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("input_ids must be a list of integers")
        return ids
    msgs = rec.get("messages")
    if msgs is None:
        raise ValueError("row has neither `messages` nor `input_ids`")
    tpl = _STATE["template"]
    if not tpl:
        raise ValueError("`messages` row but no chat template (pass --template)")
    from ..conformance.render import render_chat

    text = render_chat(tpl, msgs, tools=rec.get("tools") or None, **_STATE["render_kwargs"])
    return list(_STATE["tok"](text, add_special_tokens=False)["input_ids"])


def _work_ids(row0: int, offsets, values) -> tuple:
    """A columnar chunk of token ids: masks computed on the flat array (no Python lists)."""
    import numpy as np

    starts = offsets.tolist()
    roles: list = []
    errors: list = []
    masks = _STATE["fmt"].loss_masks(values, _STATE["tok"], policy=_STATE["policy"],
                                     strict=_STATE["strict"], on_error="record", errors=errors,
                                     roles=roles, offsets=starts)
    stats = {"roles": collections.Counter(), "tokens": 0, "trained": 0, "empty": 0}
    rejects = [{"row": row0 + j, "stage": "parse", "error": _msg(e)}
               for j, e in enumerate(errors) if e is not None]
    keep = [j for j, e in enumerate(errors) if e is None]
    lens = np.diff(offsets)[keep]
    new_off = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(lens, out=new_off[1:])
    if len(keep) == len(errors):
        ids = values
    else:
        ids = np.concatenate([values[starts[j]:starts[j + 1]] for j in keep]) if keep else \
            values[:0]
    mask = np.frombuffer(b"".join(masks[j] for j in keep), dtype=np.uint8)
    trained = np.asarray([masks[j].count(1) for j in keep], dtype=np.int64)
    for j in keep:
        stats["roles"].update(roles[j] or ())
    stats["tokens"] = int(lens.sum())
    stats["trained"] = int(trained.sum())
    stats["empty"] = int((trained == 0).sum())
    cols = _Columns(np.asarray(keep, dtype=np.int64) + row0, new_off, ids, mask, trained)
    return cols, rejects, stats


def _work(chunk) -> tuple[list[dict], list[dict], dict]:
    """One chunk: (output rows, reject rows, stats)."""
    if type(chunk) is tuple and chunk[0] == "ids":
        return _work_ids(*chunk[1:])

    good: list[tuple[int, list[int]]] = []
    rejects: list[dict] = []
    for row, rec in chunk:
        try:
            good.append((row, _ids_of(rec)))
        except Exception as exc:  # render / tokenise / input shape: reject with the error
            rejects.append({"row": row, "stage": "input", "error": _msg(exc)})
    stats = {"roles": collections.Counter(), "tokens": 0, "trained": 0, "empty": 0}
    out: list[dict] = []
    if good:
        roles: list = []
        errors: list = []
        masks = _STATE["fmt"].loss_masks([ids for _, ids in good], _STATE["tok"],
                                         policy=_STATE["policy"], strict=_STATE["strict"],
                                         on_error="record", errors=errors, roles=roles)
        for (row, ids), m, r, err in zip(good, masks, roles, errors):
            if err is not None:
                rejects.append({"row": row, "stage": "parse", "error": _msg(err)})
                continue
            k = m.count(1)
            stats["tokens"] += len(ids)
            stats["trained"] += k
            stats["empty"] += k == 0
            stats["roles"].update(r or ())
            out.append({"row": row, "input_ids": ids, "loss_mask": m, "num_trained": k})
    rejects.sort(key=lambda r: r["row"])
    return out, rejects, stats


def _msg(exc: BaseException) -> str:
    s = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {s}"


# ----------------------------------------------------------------------------- run

def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar mask``; returns the exit code (a UsageError is the caller's: 2)."""
    import chatgrammar as cg

    if args.jobs < 1 or args.chunk_size < 1:
        raise UsageError("-j and --chunk-size must be at least 1")
    if not os.path.isfile(args.input):
        raise UsageError(f"no such input file: {args.input}")
    _kind(args.input, "IN")
    _kind(args.output, "OUT")
    template = read_template(args.template)
    tok = tokenizer_arg(args.tokenizer, args.trust_remote_code)
    how = "given"
    try:
        if args.format == "auto":
            from ..conformance.infer import resolve_format
            fmt, how = resolve_format(tok, chat_template=template,
                                      **_template_kwargs(args.template_kwarg))
        else:
            fmt = cg.load_format(args.format)
    except ChatGrammarError as exc:
        raise UsageError(str(exc).splitlines()[0]) from None
    cfg = {"tokenizer": args.tokenizer, "trust_remote_code": args.trust_remote_code,
           "format": str(fmt.path) if args.format == "auto" else args.format,
           "spec_yaml": getattr(fmt, "spec_yaml", None) if how == "inferred" else None,
           "template": template, "template_kwargs": _template_kwargs(args.template_kwarg),
           "policy": policy_changes(args), "strict": not args.lenient}
    policy_for(fmt, args)  # a bad combination is a usage error here, not in every worker
    rejects_path = args.rejects or args.output + ".rejects.jsonl"
    total = count_rows(args.input)

    writer = _Writer(args.output)
    rej_f = None
    summary = {"input": args.input, "output": args.output, "format": fmt.name,
               "format_source": how, "samples": 0,
               "written": 0, "rejected": 0, "tokens": 0, "trained_tokens": 0,
               "empty_masks": 0, "roles": collections.Counter()}
    t0 = time.perf_counter()

    def consume(res) -> None:
        nonlocal rej_f
        out, rej, st = res
        writer.write(out)
        if rej:
            if rej_f is None:
                rej_f = open(rejects_path, "w", encoding="utf-8")
            rej_f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rej))
        summary["samples"] += len(out) + len(rej)
        summary["written"] += len(out)
        summary["rejected"] += len(rej)
        summary["tokens"] += st["tokens"]
        summary["trained_tokens"] += st["trained"]
        summary["empty_masks"] += st["empty"]
        summary["roles"].update(st["roles"])

    progress = _progress(args.no_progress, total)
    try:
        with progress as bar:
            task = bar.add_task("masking", total=total, rate="0")

            def done(res) -> None:
                consume(res)
                dt = max(time.perf_counter() - t0, 1e-9)
                bar.update(task, completed=summary["samples"],
                           rate=f"{summary['samples'] / dt:,.0f}")

            chunks = iter_chunks(args.input, args.chunk_size)
            if args.jobs == 1:
                _init(cfg, tok)  # the tokenizer loaded above, not loaded a second time
                for chunk in chunks:
                    done(_work(chunk))
            else:
                import multiprocessing as mp

                ctx = mp.get_context("spawn")
                with ctx.Pool(args.jobs, initializer=_init, initargs=(cfg,)) as pool:
                    pending: collections.deque = collections.deque()
                    for chunk in chunks:  # at most 2 chunks in flight per worker
                        pending.append(pool.apply_async(_work, (chunk,)))
                        while len(pending) >= 2 * args.jobs:
                            done(pending.popleft().get())
                    while pending:
                        done(pending.popleft().get())
    finally:
        writer.close()
        if rej_f is not None:
            rej_f.close()
    elapsed = time.perf_counter() - t0
    summary["roles"] = dict(sorted(summary["roles"].items()))
    summary["trained_fraction"] = (summary["trained_tokens"] / summary["tokens"]
                                   if summary["tokens"] else 0.0)
    summary["rejects_file"] = rejects_path if summary["rejected"] else None
    summary["seconds"] = round(elapsed, 3)
    summary["samples_per_second"] = round(summary["samples"] / elapsed, 1) if elapsed else None
    _print_summary(summary)
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 1 if summary["rejected"] else 0


def _progress(disabled: bool, total: int | None):
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    console = Console(stderr=True)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]} samples/s"), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console,
                    disable=disabled or not console.is_terminal)


def _print_summary(s: dict) -> None:
    lines = [
        f"format          {s['format']}" + {
            "detected": " (detected: a bundled format)",
            "inferred": " (no bundled format; inferred from the chat template and verified)",
        }.get(s.get("format_source"), ""),
        f"samples         {s['samples']:,} ({s['written']:,} written, {s['rejected']:,} rejected)",
        f"tokens          {s['tokens']:,}",
        f"trained         {s['trained_tokens']:,} ({100 * s['trained_fraction']:.1f}%)",
        f"empty masks     {s['empty_masks']:,} (parsed, but nothing trains under the policy)",
        "turns per role  " + (", ".join(f"{k} {v:,}" for k, v in s["roles"].items()) or "-"),
        f"throughput      {s['samples_per_second'] or 0:,.1f} samples/s ({s['seconds']:.1f} s)",
    ]
    if s["rejects_file"]:
        lines.append(f"rejects         {s['rejects_file']}")
    print("\n".join(lines), file=sys.stderr)
