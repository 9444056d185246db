"""`quickdraft distill`: train an EAGLE head (drafts/eagle.py) for a target by self-distillation.

1. Data: the target's own text. Prompts come from --prompts (a text or JSONL file, as `quickdraft check`
   reads them) or, with none, from the target itself: a chat model writes user questions (sampled at
   temperature 1 after its chat template's user header) and answers them; a base model samples the start of a
   text from its beginning-of-text token (temperature 1) and continues it. Answers alternate greedy and sampled
   (--temperatures), so the head sees both laws.
   Each finished sequence then goes through the target once more (a prefill, rows computed as in decoding) for
   its final hidden states, and the target's greedy token at every position (the held-out estimate's
   reference). Shards are written as they are made (OUT/work/data-NNNN.safetensors) until --tokens are held.
2. Vocabulary: the --vocab-size most frequent tokens of the data (FR-Spec), always with the end tokens.
3. Training: position p of a sequence pairs f_p with the embedding of x_{p+1}; the head is trained to give
   f_{p+1} (smooth L1) and the target's distribution over the reduced vocabulary at p+1 (cross-entropy with the
   target's own softmax, computed from f_{p+1} through the same output rows), teacher-forced, plus a second
   pass fed with its own estimates f^ (what drafting positions 2..K read). AdamW with warm-up and cosine decay,
   bf16 autocast on CPU (AMX) and CUDA. A checkpoint (OUT/work/checkpoint.pt) is written every
   --checkpoint-every steps and at each epoch's end: a rerun of the same command resumes from it.
4. After each epoch: held-out greedy agreement of the head's first and second drafts with the target's
   argmax (alpha1, alpha2) and the expected tokens per step at K = 5 they imply; the head and config.json
   (recipe, data size, timings, the estimates) are written to OUT.

The command line (its arguments, their defaults and checks) is tools/distill_cli.py, which imports this module
when the command runs.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from quickdraft.errors import QuickdraftError

QUESTION_TOKENS = 64
SHARD_SEQUENCES = 48
MAX_TRAIN_LEN = 1024
HELD_OUT = 0.04
REG_WEIGHT = 0.5  # smooth-L1 on features next to the cross-entropy
SECOND_PASS_WEIGHT = 0.5


def _log(message: str) -> None:
    print(f"[distill] {message}", file=sys.stderr, flush=True)


# --- 1. data --------------------------------------------------------------------------------------------------

def _user_header(llm) -> str | None:
    """The chat template's text up to a user message's content (None for a model without a chat template)."""
    tokenizer = llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\u2063QUESTION\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=False)
    return text.split(marker)[0] if marker in text else None


def _self_written_prompts(llm, count: int) -> list[list[int]]:
    """Prompts the target writes: a chat model's sampled user questions in its chat template, or a base model's
    beginning-of-text token."""
    from quickdraft.params import SamplingParams

    header = _user_header(llm)
    if header is None:  # a base model: the start of a text it samples from its beginning-of-text token
        bos = getattr(llm.tokenizer, "bos_token_id", None) if llm.tokenizer is not None else None
        if bos is None:
            raise QuickdraftError("this model has neither a chat template nor a beginning-of-text token to write "
                                  "its own prompts from; pass --prompts FILE")
        params = SamplingParams(temperature=1.0, max_tokens=QUESTION_TOKENS // 2)
        outs = llm.generate([{"prompt_token_ids": [bos]}] * count, params)
        return [[bos] + out.outputs[0].token_ids for out in outs]
    ids = llm.tokenizer(header, add_special_tokens=False)["input_ids"]
    # No per-request seed: seeded requests draw position-keyed noise over the whole vocabulary at every step,
    # several times dearer than the generator's draw, and data need not be reproducible token for token.
    params = [SamplingParams(temperature=1.0, max_tokens=QUESTION_TOKENS)] * count
    outs = llm.generate([{"prompt_token_ids": ids}] * count, params)
    prompts = []
    for out in outs:
        question = out.outputs[0].text.strip()
        if question:
            prompts.append(llm.chat_prompt([{"role": "user", "content": question}])["prompt_token_ids"])
    return prompts


def _file_prompts(llm, path: str) -> list[list[int]]:
    from quickdraft.tools.prompts import prompt_token_ids, read_prompts

    chat = _user_header(llm) is not None
    return [prompt_token_ids(llm, p, chat=chat and not isinstance(p, dict)) for p in read_prompts(path)]


@torch.inference_mode()
def _features(target, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states [sum L, hidden] and the target's greedy token at every position [sum L] of each
    sequence, by one prefill each (several per forward)."""
    feats, tops = [], []
    for start in range(0, len(sequences), 8):
        group = sequences[start:start + 8]
        caches = [target.new_cache() for _ in group]
        _, hidden = target.forward_batch(caches, [torch.tensor(s) for s in group], [0] * len(group),
                                         return_hidden=True)
        feats.append(hidden.to(torch.bfloat16).cpu())
        for chunk in hidden.split(256):  # the greedy token at every position, a chunk of logits at a time
            tops.append(target.output_logits(chunk).argmax(-1).to(torch.int32).cpu())
        del caches
    return torch.cat(feats), torch.cat(tops)


def _generate_shard(llm, prompts: list[list[int]], temperatures: tuple[float, ...],
                    max_new_tokens: int) -> dict[str, torch.Tensor]:
    from quickdraft.params import SamplingParams

    limit = llm.engine.max_len - 1
    prompts = [p[-(limit - max_new_tokens):] for p in prompts]
    params = [SamplingParams(temperature=temperatures[i % len(temperatures)], max_tokens=max_new_tokens)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sequences = [(p + out.outputs[0].token_ids)[:MAX_TRAIN_LEN] for p, out in zip(prompts, outs)]
    sequences = [s for s in sequences if len(s) >= 3]
    feats, tops = _features(llm.target, sequences)
    return {"tokens": torch.tensor([t for s in sequences for t in s], dtype=torch.int32),
            "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int32),
            "prompt_lengths": torch.tensor([min(len(p), len(s)) for p, s in zip(prompts, sequences)],
                                           dtype=torch.int32),
            "features": feats, "target_top": tops}


def make_data(llm, work: Path, tokens: int, prompts_file: str | None, temperatures: tuple[float, ...],
              max_new_tokens: int) -> list[dict[str, torch.Tensor]]:
    """Shards of self-distillation data in `work` until they hold `tokens` tokens (existing shards kept)."""
    from safetensors.torch import load_file, save_file

    shards = [load_file(str(p)) for p in sorted(work.glob("data-*.safetensors"))]
    held = sum(int(s["lengths"].sum()) for s in shards)
    if held >= tokens:
        _log(f"data: {len(shards)} shards, {held} tokens (reused)")
        return shards
    file_prompts = _file_prompts(llm, prompts_file) if prompts_file else None
    if file_prompts is not None and not file_prompts:
        raise QuickdraftError(f"{prompts_file} holds no prompts")
    started = time.perf_counter()
    while held < tokens:
        index = len(shards)
        if file_prompts is not None:
            prompts = [file_prompts[(index * SHARD_SEQUENCES + i) % len(file_prompts)] for i in range(SHARD_SEQUENCES)]
        else:
            prompts = _self_written_prompts(llm, SHARD_SEQUENCES)
        shard = _generate_shard(llm, prompts, temperatures, max_new_tokens)
        path = work / f"data-{index:04d}.safetensors"
        save_file(shard, str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").replace(path)
        shards.append(shard)
        held += int(shard["lengths"].sum())
        rate = held / max(time.perf_counter() - started, 1e-9)
        _log(f"data: shard {index}: {len(shard['lengths'])} sequences, {held}/{tokens} tokens "
             f"({rate:.0f} tok/s this run)")
    return shards


# --- 2. vocabulary -----------------------------------------------------------------------------------------

def reduced_vocab(shards: list[dict[str, torch.Tensor]], vocab_size: int, size: int,
                  always: set[int]) -> torch.Tensor:
    """The `size` most frequent tokens of the data (ties by id), with `always` included; sorted ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for shard in shards:
        counts += torch.bincount(shard["tokens"].long(), minlength=vocab_size)[:vocab_size]
    size = min(size, vocab_size)
    for t in always:
        if 0 <= t < vocab_size:
            counts[t] = counts.max() + 1
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    return torch.sort(order).values


# --- 3. training -----------------------------------------------------------------------------------------

def examples(shards) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The sequences of the shards as (tokens [L], features [L, hidden], target_top [L]) views."""
    items = []
    for shard in shards:
        offset = 0
        for length in shard["lengths"].tolist():
            items.append((shard["tokens"][offset:offset + length].long(), shard["features"][offset:offset + length],
                          shard["target_top"][offset:offset + length].long()))
            offset += length
    return items


def _batches(items: list, max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped by similar length, at most max_tokens padded positions a batch, in random order."""
    order = sorted(range(len(items)), key=lambda i: (items[i][0].shape[0], rng.random()))
    batches, batch, longest = [], [], 0
    for i in order:
        length = items[i][0].shape[0]
        if batch and max(longest, length) * (len(batch) + 1) > max_tokens:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, length)
    if batch:
        batches.append(batch)
    rng.shuffle(batches)
    return batches


def _collate(items, indices, embed, device):
    """Padded inputs of a batch: features f_p and embeddings of x_{p+1} for p < L - 1, the targets f_{p+1},
    the target's greedy token at p + 1 (its next token after x_{p+1}), and the mask of real positions."""
    group = [items[i] for i in indices]
    width = max(t.shape[0] for t, _, _ in group) - 1
    hidden = group[0][1].shape[1]
    feats = torch.zeros(len(group), width + 1, hidden)
    next_ids = torch.zeros(len(group), width, dtype=torch.long)
    tops = torch.full((len(group), width), -1, dtype=torch.long)
    mask = torch.zeros(len(group), width, dtype=torch.bool)
    for b, (tokens, f, top) in enumerate(group):
        n = tokens.shape[0] - 1
        feats[b, : n + 1] = f.float()
        next_ids[b, :n] = tokens[1:]
        tops[b, :n] = top[1:]
        mask[b, :n] = True
    embeds = embed(next_ids.reshape(-1)).reshape(len(group), width, hidden).float().clone()
    return (feats[:, :-1].to(device), embeds.to(device), feats[:, 1:].to(device), tops.to(device),
            mask.to(device))


def _losses(head, inputs, embeds, target_feats, mask, attention_mask):
    """(loss, first-pass estimate, first-pass logits, second-pass logits)."""
    with torch.no_grad():
        target_probs = torch.softmax(head.logits(target_feats).float(), -1)  # the target's law over V'
    estimate, logits = head(inputs, embeds, attention_mask)
    # The second pass reads its own estimates where drafting does: f^_p in place of f_p (shifted by one).
    shifted = torch.cat([inputs[:, :1], estimate[:, :-1].detach().to(inputs.dtype)], 1)
    estimate2, logits2 = head(shifted, embeds, attention_mask)
    total = 0.0
    for weight, est, lg in ((1.0, estimate, logits), (SECOND_PASS_WEIGHT, estimate2, logits2)):
        ce = -(target_probs * torch.log_softmax(lg.float(), -1)).sum(-1)
        reg = F.smooth_l1_loss(est.float(), target_feats, reduction="none").mean(-1)
        total = total + weight * ((ce + REG_WEIGHT * reg) * mask).sum() / mask.sum()
    return total, logits, logits2


@torch.no_grad()
def held_out_estimate(head, items, embed, device, autocast) -> dict[str, float]:
    """Greedy agreement of the head's first (teacher-forced) and second (own-estimate) drafts with the target's
    argmax on held-out sequences, and the tokens per step at K = 5 they imply (alpha1 then alpha2 per position)."""
    head.eval()
    agree = [0, 0]
    total = 0
    rng = random.Random(0)
    for batch in _batches(items, 4096, rng):
        inputs, embeds, target_feats, tops, mask = _collate(items, batch, embed, device)
        with autocast():
            _, lg1, lg2 = _losses(head, inputs, embeds, target_feats, mask, None)
        for n, lg in enumerate((lg1, lg2)):
            picks = head.vocab_ids[lg.float().argmax(-1)]
            agree[n] += int(((picks == tops) & mask).sum())
        total += int(mask.sum())
    head.train()
    a1, a2 = agree[0] / max(total, 1), agree[1] / max(total, 1)
    tokens = 1 + sum(a1 * a2 ** (i - 1) for i in range(1, 6))
    return {"alpha1": round(a1, 4), "alpha2": round(a2, 4), "tokens_per_step_k5": round(tokens, 3),
            "positions": total}


def train(llm, shards, vocab_ids, out: Path, work: Path, epochs: int, lr: float, batch_tokens: int,
          seed: int, device: torch.device, checkpoint_every: int, recipe: dict[str, Any]) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from quickdraft.drafts.eagle import new_head

    target = llm.target
    head = new_head(target, vocab_ids, seed).to(device)
    rng = random.Random(seed)
    items = examples(shards)
    rng.shuffle(items)
    n_held = max(1, int(len(items) * HELD_OUT))
    held_out, train_items = items[:n_held], items[n_held:]
    if not train_items:
        raise QuickdraftError("too little data to train on; raise --tokens")
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = len(_batches(train_items, batch_tokens, random.Random(0)))
    total_steps = max(1, steps_per_epoch * epochs)
    warmup = min(100, total_steps // 10 + 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / total_steps))))
    checkpoint = work / "checkpoint.pt"
    # What a checkpoint must match to be resumed: the data and the schedule.
    run_key = {"sequences": len(items), "epochs": epochs, "lr": lr, "batch_tokens": batch_tokens, "seed": seed}
    step, history, train_seconds = 0, [], 0.0
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        same = torch.equal(state["vocab_ids"], vocab_ids.cpu()) and state.get("run") == run_key
        if not same:
            _log("the checkpoint was made with other data or settings: training afresh")
        else:
            head.load_state_dict(state["head"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            step, history, train_seconds = state["step"], state["history"], state["train_seconds"]
            _log(f"resuming at step {step} of {total_steps}")
    embed_table = lambda ids: target.embed_rows(ids).float().cpu()  # noqa: E731 (the target's own lookup)
    use_bf16 = device.type == "cuda" or (device.type == "cpu" and torch.backends.mkldnn.is_available())

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    def save_checkpoint():
        torch.save({"head": {k: v for k, v in head.state_dict().items()}, "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "step": step, "history": history,
                    "train_seconds": train_seconds, "vocab_ids": vocab_ids.cpu(), "run": run_key},
                   work / "checkpoint.tmp")
        (work / "checkpoint.tmp").replace(checkpoint)

    head.train()
    columns = [TextColumn("[distill] epoch {task.fields[epoch]}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, transient=False, redirect_stdout=False) as progress:
        task = progress.add_task("train", total=total_steps, completed=step, epoch=step // steps_per_epoch + 1,
                                 loss=float("nan"))
        while step < total_steps:
            epoch = step // steps_per_epoch
            batches = _batches(train_items, batch_tokens, random.Random(seed * 1000 + epoch))
            for batch in batches[step - epoch * steps_per_epoch:]:
                t0 = time.perf_counter()
                inputs, embeds, target_feats, _, mask = _collate(train_items, batch, embed_table, device)
                with autocast():
                    loss, _, _ = _losses(head, inputs, embeds, target_feats, mask, None)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                step += 1
                train_seconds += time.perf_counter() - t0
                progress.update(task, advance=1, loss=loss.item(), epoch=epoch + 1)
                if step % checkpoint_every == 0:
                    save_checkpoint()
            estimate = held_out_estimate(head, held_out, embed_table, device, autocast)
            history.append({"epoch": epoch + 1, "step": step, **estimate})
            progress.console.print(f"[distill] epoch {epoch + 1}: held-out alpha1 {estimate['alpha1']:.3f}, "
                                   f"alpha2 {estimate['alpha2']:.3f}, ~{estimate['tokens_per_step_k5']:.2f} "
                                   f"tokens/step at K=5 ({estimate['positions']} positions)")
            save_checkpoint()
            head.save(out, {**recipe, "train_seconds": round(train_seconds, 1), "steps": step,
                            "held_out": history})
    return {"history": history, "train_seconds": train_seconds, "steps": step}


# --- the command's run ----------------------------------------------------------------------------------

def run(args: argparse.Namespace, temperatures: tuple[float, ...]) -> int:
    """`quickdraft distill`'s work, its arguments checked (tools/distill_cli.py) and --temperatures read."""
    from quickdraft import LLM
    from quickdraft.models import loader

    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or loader.DEFAULT_MODEL
    llm = LLM(model, dtype=args.dtype, device=args.device, speculative_config={"method": "none"})
    device = llm.device
    recipe = {"command": "quickdraft distill " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["distill"] else None,
              "model": model, "tokens": args.tokens, "vocab_size": args.vocab_size, "epochs": args.epochs,
              "lr": args.lr, "batch_tokens": args.batch_tokens, "max_new_tokens": args.max_new_tokens,
              "temperatures": list(temperatures), "prompts": args.prompts or "self-written", "seed": args.seed,
              "device": str(device), "target_dtype": str(llm.target.dtype).replace("torch.", ""),
              "reg_weight": REG_WEIGHT, "second_pass_weight": SECOND_PASS_WEIGHT}
    started = time.perf_counter()
    shards = make_data(llm, work, args.tokens, args.prompts, temperatures, args.max_new_tokens)
    data_seconds = time.perf_counter() - started
    always = set(llm.engine.eos_token_ids)
    vocab_ids = reduced_vocab(shards, llm.target.vocab_size, args.vocab_size, always)
    tokens = torch.cat([s["tokens"] for s in shards]).long()
    coverage = float(torch.isin(tokens, vocab_ids).float().mean())
    recipe.update(data_tokens=int(tokens.numel()), data_sequences=sum(len(s["lengths"]) for s in shards),
                  data_seconds=round(data_seconds, 1), vocab_coverage=round(coverage, 4))
    _log(f"vocabulary: {len(vocab_ids)} tokens cover {coverage:.1%} of the data's tokens")
    result = train(llm, shards, vocab_ids, out, work, args.epochs, args.lr, args.batch_tokens, args.seed, device,
                   args.checkpoint_every, recipe)
    final = result["history"][-1]
    _log(f"wrote {out} (alpha1 {final['alpha1']:.3f}, alpha2 {final['alpha2']:.3f}; "
         f"{result['train_seconds']:.0f} s of training); use it with --draft eagle:{out}")
    return 0
