"""`quickdraft batch`: offline inference over a JSONL file, on the local engine or on Ray Data.

Input: one JSON object per line (blank lines are skipped), each with exactly one of
- "prompt": a text to continue,
- "messages": a chat, [{"role": ..., "content": ...}, ...], through the model's chat template,
- "prompt_token_ids": a list of token ids,
an optional "id" (a string or an integer; default: the record's line number, from 1), and optional sampling fields
(SAMPLING_FIELDS: SamplingParams' names) that override the command's defaults for that record. The file is
checked before the model loads (JSON, fields, values, unique ids), and against the model once it has loaded
(token ids in the vocabulary, prompts within the context, the chat template), before anything is generated: a
bad record fails the run with its line number, and nothing is written.

Output: one JSON line per record, in input order: id, text, token_ids, finish_reason, usage (prompt, completion
and total tokens) and spec_decode (the server's speculation fields: num_drafts, draft_tokens, accepted_tokens,
acceptance_rate, mean_acceptance_length, tokens_per_target_forward, accepted_per_position). It is written to a
temporary file beside the output and renamed at the end, so a failed run leaves no partial output.

Locally every record runs in one LLM.generate call, one continuous batch (up to max_num_seqs sequences per
step). With Ray (`run_ray`), Ray Data's map_batches sends batches of records to a pool of actors, each holding
one LLM, and each batch is one continuous batch on its actor. Greedy and seeded records give the same output
either way.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable

from quickdraft.errors import QuickdraftError
from quickdraft.params import SamplingParams

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.init and f.name != "n")
RECORD_FIELDS = ("id", *PROMPT_FIELDS, *SAMPLING_FIELDS)
RAY_MISSING = "Ray is not installed: install quickdraft[ray] (pip install 'quickdraft[ray]') to run batches on Ray"


@dataclass
class BatchRecord:
    """One input line, checked: its prompt (one of three kinds) and its sampling fields (the defaults merged)."""

    line: int  # 1-based line number in the input file
    id: str | int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(**(self.sampling or {}))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BatchRecord":
        return cls(**data)


def _where(source: str, line: int) -> str:
    return f"{source}:{line}"


def parse_record(data: Any, line: int, defaults: dict[str, Any] | None = None, source: str = "input") -> BatchRecord:
    """A checked BatchRecord from one parsed JSON line; QuickdraftError naming the line and the problem."""
    where = _where(source, line)
    if not isinstance(data, dict):
        raise QuickdraftError(f"{where}: a record is a JSON object, got {type(data).__name__}")
    unknown = [k for k in data if k not in RECORD_FIELDS]
    if unknown:
        raise QuickdraftError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} "
                              f"{', '.join(repr(k) for k in unknown)}; a record has 'id', one of 'prompt', "
                              f"'messages' or 'prompt_token_ids', and sampling fields: {', '.join(SAMPLING_FIELDS)}"
                              + (" (n is not supported: give one record per completion)" if "n" in unknown else ""))
    given = [k for k in PROMPT_FIELDS if k in data]
    if len(given) != 1:
        raise QuickdraftError(f"{where}: give exactly one of 'prompt', 'messages' or 'prompt_token_ids'"
                              + (f"; got {', '.join(given)}" if given else ""))
    record_id = data.get("id", line)
    if not (isinstance(record_id, str) or (isinstance(record_id, int) and not isinstance(record_id, bool))):
        raise QuickdraftError(f"{where}: id must be a string or an integer, got {record_id!r}")
    record = BatchRecord(line, record_id)
    kind = given[0]
    value = data[kind]
    if kind == "prompt":
        if not isinstance(value, str) or not value.strip():
            raise QuickdraftError(f"{where}: prompt must be a non-empty string, got {value!r}")
        record.prompt = value
    elif kind == "messages":
        if not (isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)):
            raise QuickdraftError(f"{where}: messages must be a non-empty list of "
                                  "{'role': str, 'content': str} objects")
        record.messages = value
    else:
        if not (isinstance(value, list) and value and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
            raise QuickdraftError(f"{where}: prompt_token_ids must be a non-empty list of token ids (integers >= 0)")
        record.prompt_token_ids = value
    sampling = {**(defaults or {}), **{k: data[k] for k in SAMPLING_FIELDS if k in data}}
    try:
        SamplingParams(**sampling)
    except (QuickdraftError, TypeError) as exc:
        raise QuickdraftError(f"{where}: {exc}") from None
    record.sampling = sampling
    return record


def read_records(path: str | os.PathLike, defaults: dict[str, Any] | None = None) -> list[BatchRecord]:
    """Every record of a JSONL file, checked (see the module's docstring); ids must be unique."""
    path = Path(path)
    if not path.exists():
        raise QuickdraftError(f"--input {path}: no such file")
    if not path.is_file():
        raise QuickdraftError(f"--input {path}: not a file")
    records: list[BatchRecord] = []
    seen: dict[Any, int] = {}
    with open(path, encoding="utf-8") as f:
        for line_number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise QuickdraftError(f"{_where(str(path), line_number)}: not valid JSON: {exc.msg} "
                                      f"(column {exc.colno})") from None
            record = parse_record(data, line_number, defaults, str(path))
            key = (type(record.id).__name__, record.id)
            if key in seen:
                raise QuickdraftError(f"{_where(str(path), line_number)}: id {record.id!r} is already used on line "
                                      f"{seen[key]}; give each record its own id")
            seen[key] = line_number
            records.append(record)
    if not records:
        raise QuickdraftError(f"--input {path}: no records (one JSON object per line)")
    return records


# --- generation ---------------------------------------------------------------------------------------------
def _prompt(llm, record: BatchRecord) -> dict[str, Any]:
    """The record's prompt as LLM.generate takes it (token ids included), checked against the model."""
    where = f"record {record.id!r} (line {record.line})"
    if record.messages is not None:
        try:
            prompt = llm.chat_prompt(record.messages)
        except QuickdraftError as exc:
            raise QuickdraftError(f"{where}: {exc}") from None
        except Exception as exc:  # the template's own checks (e.g. role order)
            raise QuickdraftError(f"{where}: the chat template refused these messages: {exc}") from None
    elif record.prompt is not None:
        if llm.tokenizer is None:
            raise QuickdraftError(f"{where}: model '{llm.model_name}' has no tokenizer; give prompt_token_ids")
        prompt = {"prompt": record.prompt, "prompt_token_ids": llm.tokenizer(record.prompt)["input_ids"]}
    else:
        vocab = llm.engine.target.vocab_size
        bad = [t for t in record.prompt_token_ids if t >= vocab]
        if bad:
            raise QuickdraftError(f"{where}: prompt_token_ids must be ids in [0, {vocab}); got {bad[:5]}")
        prompt = {"prompt_token_ids": list(record.prompt_token_ids)}
    length, max_len = len(prompt["prompt_token_ids"]), llm.engine.max_len
    if length >= max_len:
        raise QuickdraftError(f"{where}: the prompt has {length} tokens but the context holds {max_len}; "
                              "shorten it")
    return prompt


def spec_decode(metrics) -> dict[str, Any]:
    """A request's speculation, with the server's field names (protocol.SpecDecodeStats), `lossy` included."""
    return metrics.spec_decode_fields()


def generate_records(llm, records: list[BatchRecord]) -> list[dict[str, Any]]:
    """Every record's result, in order, from one LLM.generate call (one continuous batch)."""
    prompts = [_prompt(llm, record) for record in records]
    outputs = llm.generate(prompts, [record.params() for record in records])
    results = []
    for record, out in zip(records, outputs):
        completion = out.outputs[0]
        prompt_tokens, completion_tokens = len(out.prompt_token_ids), len(completion.token_ids)
        results.append({"id": record.id, "text": completion.text, "token_ids": list(completion.token_ids),
                        "finish_reason": completion.finish_reason,
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                  "total_tokens": prompt_tokens + completion_tokens},
                        "spec_decode": spec_decode(out.metrics)})
    return results


def run_local(llm, records: list[BatchRecord]) -> list[dict[str, Any]]:
    return generate_records(llm, records)


def load_llm(llm_kwargs: dict[str, Any]):
    from quickdraft.api import LLM, freeze_loaded_objects
    from quickdraft.models.loader import quiet_transformers

    quiet_transformers()
    kwargs = dict(llm_kwargs)
    llm = LLM(kwargs.pop("model"), **kwargs)
    freeze_loaded_objects()
    return llm


class RayBatchPredictor:
    """A Ray Data actor: one LLM, and each batch of records (their JSON) through it in one continuous batch."""

    def __init__(self, llm_kwargs: dict[str, Any]):
        self.llm = load_llm(llm_kwargs)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch's results as JSON, with the actor's name; a bad record (a QuickdraftError, e.g. a prompt over
        the context) comes back as the batch's `error`, which the driver raises as it is (Ray would wrap an
        exception in its own, traceback and all)."""
        indices = [int(i) for i in batch["index"]]
        records = [BatchRecord.from_json(json.loads(text)) for text in batch["record"]]
        try:
            results, error = [json.dumps(r) for r in generate_records(self.llm, records)], ""
        except QuickdraftError as exc:
            results, error = [""] * len(records), str(exc)
        return {"index": indices, "result": results, "error": [error] * len(records),
                "worker": [self.worker] * len(records)}


def run_ray(records: list[BatchRecord], llm_kwargs: dict[str, Any], replicas: int = 1, batch_size: int | None = None,
            num_cpus: float | None = 1, num_gpus: float | None = None) -> tuple[list[dict[str, Any]], set[str]]:
    """(results in input order, the actors that produced them): Ray Data's map_batches over a pool of `replicas`
    actors, each holding LLM(**llm_kwargs). Uses the Ray instance this process is connected to, else
    ray.init() (RAY_ADDRESS, or a new local instance). batch_size: records per batch (default: the records
    spread evenly over the actors, at most 4 x max_num_seqs per batch). Each actor takes num_cpus CPUs and
    num_gpus GPUs (default: one when the model runs on CUDA); all of them start before the first batch."""
    try:
        import ray
        import ray.data
    except ImportError as exc:
        raise QuickdraftError(f"{RAY_MISSING} ({exc})") from None
    if not (isinstance(replicas, int) and replicas >= 1):
        raise QuickdraftError(f"--replicas must be an integer >= 1, got {replicas!r}")
    if batch_size is None:
        batch_size = max(1, min(4 * (llm_kwargs.get("max_num_seqs") or 64), math.ceil(len(records) / replicas)))
    elif not (isinstance(batch_size, int) and batch_size >= 1):
        raise QuickdraftError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
    if num_gpus is None:  # one GPU per actor when the model runs on CUDA
        device = str(llm_kwargs.get("device", "auto"))
        if device == "auto":
            import torch

            num_gpus = 1 if torch.cuda.is_available() else 0
        else:
            num_gpus = 1 if device.startswith("cuda") else 0
    if not ray.is_initialized():
        ray.init()
    _warn_if_short(ray.cluster_resources(), replicas, num_cpus or 0, num_gpus or 0)
    context = ray.data.DataContext.get_current()
    # Every actor loads its model before the first batch goes out (else the first one ready could take them all).
    wait_before = getattr(context, "wait_for_min_actors_s", None)
    if wait_before is not None:
        context.wait_for_min_actors_s = 3600
    items = [{"index": i, "record": json.dumps(record.to_json())} for i, record in enumerate(records)]
    # One batch at a time per actor: each batch is a continuous batch of its own, and the next goes to whichever
    # actor is free first.
    pool = ray.data.ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1)
    dataset = ray.data.from_items(items).map_batches(
        RayBatchPredictor, fn_constructor_kwargs={"llm_kwargs": dict(llm_kwargs)}, compute=pool,
        batch_size=batch_size, batch_format="numpy", num_cpus=num_cpus, num_gpus=num_gpus)
    results: list[dict[str, Any] | None] = [None] * len(records)
    workers: set[str] = set()
    try:
        for row in dataset.iter_rows():
            if row["error"]:
                raise QuickdraftError(str(row["error"]))
            results[int(row["index"])] = json.loads(row["result"])
            workers.add(str(row["worker"]))
    finally:
        if wait_before is not None:
            context.wait_for_min_actors_s = wait_before
    missing = [records[i].line for i, r in enumerate(results) if r is None]
    if missing:
        raise QuickdraftError(f"Ray Data returned no result for the records on lines {missing[:10]}")
    return results, workers


def _warn_if_short(resources: dict[str, float], replicas: int, num_cpus: float, num_gpus: float) -> None:
    cpus, gpus = resources.get("CPU", 0), resources.get("GPU", 0)
    if cpus < replicas * num_cpus or gpus < replicas * num_gpus:
        print(f"[quickdraft] warning: the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs, and {replicas} actors need "
              f"{replicas * num_cpus:g} and {replicas * num_gpus:g}: the batch waits until they all fit (lower "
              "--replicas?)", file=sys.stderr)


# --- output -------------------------------------------------------------------------------------------------
def check_output_path(output: str | os.PathLike, input_path: str | os.PathLike) -> Path:
    output = Path(output)
    if output.exists() and output.resolve() == Path(input_path).resolve():
        raise QuickdraftError(f"--output {output} is the input file; write the results elsewhere")
    if output.is_dir():
        raise QuickdraftError(f"--output {output} is a directory; give a file name")
    if not output.parent.is_dir():
        raise QuickdraftError(f"--output {output}: the directory {output.parent} does not exist")
    return output


def write_results(path: str | os.PathLike, results: Iterable[dict[str, Any]]) -> None:
    """One JSON line per result, through a temporary file renamed over `path` once complete."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for result in results:
                f.write(json.dumps(result, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def summary_line(results: list[dict[str, Any]], wall_s: float, output: str, workers: set[str] | None = None) -> str:
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    drafted = sum(r["spec_decode"]["draft_tokens"] for r in results)
    accepted = sum(r["spec_decode"]["accepted_tokens"] for r in results)
    parts = [f"{len(results)} records -> {output}", f"{tokens} tokens in {wall_s:.2f} s",
             f"{tokens / wall_s if wall_s > 0 else 0:.1f} tok/s"]
    parts.append(f"accepted {accepted}/{drafted} drafts ({accepted / drafted:.1%})" if drafted
                 else "no drafts proposed")
    lossy = sum(bool(r["spec_decode"].get("lossy")) for r in results)
    if lossy:
        parts.append(f"LOSSY: {lossy} of {len(results)} records verified with relaxed acceptance, their output "
                     "does not follow the target's distribution")
    if workers is not None:
        parts.append(f"on Ray Data, {len(workers)} actor{'s' if len(workers) != 1 else ''}")
    return "[quickdraft] " + " | ".join(parts)


__all__ = ["BatchRecord", "PROMPT_FIELDS", "RECORD_FIELDS", "SAMPLING_FIELDS", "RayBatchPredictor",
           "check_output_path", "generate_records", "load_llm", "parse_record", "read_records", "run_local",
           "run_ray", "spec_decode", "summary_line", "write_results"]
