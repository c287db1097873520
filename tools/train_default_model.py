#!/usr/bin/env python3
"""Train SpecDeck's bundled default model (specdeck-tiny) from text that is already on the machine, and export it.

One command does everything: corpus (the Python standard library and installed packages: source as code, docs and
docstrings as prose; deduplicated; held-out split by file) -> byte-level BPE tokenizer (ids by descending corpus
frequency) -> a small Qwen3.5 hybrid model (gated delta-net + gated attention) trained jointly with one MTP layer
-> export as a Hugging Face directory (config.json, bf16 safetensors shards <= 15 MiB + index, tokenizer.json,
generation_config.json, MODEL_CARD.md) -> checks (transformers loads the target part and gives the same logits).

  # the bundled model (one NVIDIA H200, about 8 minutes all included):
  python tools/train_default_model.py --minutes 7.5 --out assets/models/specdeck-tiny
  # a quick end-to-end run on a CPU (tiny corpus and model, a minute or so; writes to a temporary directory):
  python tools/train_default_model.py --smoke

`--minutes` is the wall-clock budget of the WHOLE run (corpus, tokenizer, training, evaluation, export): training
stops early enough that evaluation and export still fit. See tools/train_corpus.py, tools/train_tokenizer.py and
tools/train_model.py for the pieces (tests: tests/test_default_model_training.py).
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import train_corpus  # noqa: E402
import train_model as tm  # noqa: E402
import train_tokenizer as tt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "assets" / "models" / "specdeck-tiny"
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.time() - T_START:7.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output model directory (default {DEFAULT_OUT}; with --smoke a new temporary directory)",
    )
    p.add_argument(
        "--minutes", type=float, default=None, help="wall-clock budget of the whole run (default 7.5; smoke 1.0)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny corpus, tiny model, a few steps (CPU, ~1 minute)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 64; smoke 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512; smoke 64)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    p.add_argument("--final-lr-frac", type=float, default=0.1, help="cosine floor as a fraction of the peak")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.8, help="weight of the MTP (token after next) loss")
    p.add_argument(
        "--mtp-chain-weight", type=float, default=0.4, help="weight of the chained second MTP step's loss (0 = off)"
    )
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: the budget)")
    p.add_argument("--vocab", type=int, default=None, help="BPE vocabulary size (default 16384; smoke 1024)")
    p.add_argument("--code-mb", type=float, default=None, help="code cap in MB (default 160; smoke 1.2)")
    p.add_argument("--prose-mb", type=float, default=None, help="prose cap in MB (default 60; smoke 0.5)")
    p.add_argument(
        "--tok-sample-mb",
        type=float,
        default=None,
        help="training text the BPE is trained on, in MB (default 48; smoke: all)",
    )
    p.add_argument("--eval-seqs", type=int, default=None, help="held-out sequences evaluated (default 256; smoke 8)")
    p.add_argument("--metrics", type=Path, default=None, help="also write the metrics JSON (with the log) here")
    p.add_argument(
        "--no-card", action="store_true", help="do not write MODEL_CARD.md (write it later with --card-from)"
    )
    p.add_argument(
        "--card-from",
        type=Path,
        default=None,
        help="only (re)write MODEL_CARD.md in --out from a metrics JSON written by an earlier run",
    )
    a = p.parse_args(argv)
    smoke = a.smoke

    def d(name, full, small):
        if getattr(a, name) is None:
            setattr(a, name, small if smoke else full)

    d("minutes", 7.5, 1.0)
    d("batch", 64, 8)
    d("seq", 512, 64)
    d("vocab", 16384, 1024)
    d("code_mb", 160.0, 1.2)
    d("prose_mb", 60.0, 0.5)
    d("tok_sample_mb", 48.0, 1e9)
    d("eval_seqs", 256, 8)
    if a.out is None and a.card_from is None:
        a.out = Path(tempfile.mkdtemp(prefix="specdeck-tiny-smoke-")) if smoke else DEFAULT_OUT
    if smoke and a.max_steps is None:
        a.max_steps = 80
    if smoke:
        a.warmup = min(a.warmup, 10)
    return a


def model_shape(args) -> dict:
    if args.smoke:
        return dict(
            hidden_size=128,
            layer_types=(tm.LINEAR, tm.LINEAR, tm.FULL, tm.LINEAR),
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
        )
    return {}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def tokenizer_sample(docs, cap_bytes: float, seed: int):
    """A deterministic sample of training documents (smallest hash first) of about cap_bytes."""
    if cap_bytes >= sum(len(d.text) for d in docs):
        return [d.text for d in docs]
    salt = f"specdeck-tok-{seed}:"
    order = sorted(range(len(docs)), key=lambda i: (train_corpus.path_hash(docs[i].path, salt), docs[i].path))
    out, n = [], 0
    for i in order:
        if n >= cap_bytes:
            break
        out.append(i)
        n += len(docs[i].text)
    return [docs[i].text for i in sorted(out)]


def pack(encoded: list[np.ndarray]) -> np.ndarray:
    """Documents joined into one stream, each followed by <|endoftext|> (id 0)."""
    parts = []
    eot = np.zeros(1, dtype=np.int32)
    for e in encoded:
        parts.append(e)
        parts.append(eot)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


class Batches:
    """Shuffled windows of seq+3 tokens (stride seq) over the packed stream; one permutation per epoch."""

    def __init__(self, stream: torch.Tensor, seq: int, batch: int, seed: int):
        self.stream, self.seq, self.batch, self.seed = stream, seq, batch, seed
        self.n = (stream.numel() - (seq + 3)) // seq + 1
        if self.n < batch:
            raise ValueError(f"corpus too small: {self.n} windows for a batch of {batch}")
        self.epoch, self.pos, self.perm = 0, 0, self._perm(0)
        self.offsets = torch.arange(seq + 3, device=stream.device)

    def _perm(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        return torch.randperm(self.n, generator=g).to(self.stream.device)

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > self.n:
            self.epoch += 1
            self.pos, self.perm = 0, self._perm(self.epoch)
        idx = self.perm[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return self.stream[(idx * self.seq)[:, None] + self.offsets[None, :]].long()

    @property
    def epochs(self) -> float:
        return self.epoch + self.pos / self.n


def eval_windows(stream: torch.Tensor, seq: int, max_seqs: int) -> torch.Tensor:
    n = min(max_seqs, (stream.numel() - (seq + 3)) // seq + 1)
    if n <= 0:
        raise ValueError("held-out stream too short")
    starts = torch.arange(n, device=stream.device) * seq
    return stream[starts[:, None] + torch.arange(seq + 3, device=stream.device)[None, :]].long()


@torch.no_grad()
def evaluate(model, mtp, windows: torch.Tensor, batch: int, amp: bool) -> dict:
    model.eval()
    mtp.eval()
    sums = {k: 0.0 for k in ("loss", "acc", "mtp_loss", "mtp_acc", "chain_loss", "chain_acc", "agree1", "agree2")}
    n0 = n_ag1 = n_ag2 = 0
    for s in range(0, windows.shape[0], batch):
        w = windows[s : s + batch]
        with torch.autocast(w.device.type, dtype=torch.bfloat16, enabled=amp):
            (l0, l1, l2), (t0, t1, t2) = tm.forward_all(model, mtp, w, chain=True)
        l0, l1, l2 = l0.float(), l1.float(), l2.float()
        cnt = t0.numel()
        sums["loss"] += tm.ce(l0, t0).item() * cnt
        sums["mtp_loss"] += tm.ce(l1, t1).item() * cnt
        sums["chain_loss"] += tm.ce(l2, t2).item() * cnt
        p0, p1, p2 = l0.argmax(-1), l1.argmax(-1), l2.argmax(-1)
        sums["acc"] += (p0 == t0).sum().item()
        sums["mtp_acc"] += (p1 == t1).sum().item()
        sums["chain_acc"] += (p2 == t2).sum().item()
        # agreement with the target's own greedy choice (what greedy speculative decoding accepts):
        # MTP row r predicts position r+2, the target predicts it at row r+1 (row r+2 for the chained step)
        sums["agree1"] += (p1[:, :-1] == p0[:, 1:]).sum().item()
        sums["agree2"] += (p2[:, :-2] == p0[:, 2:]).sum().item()
        n0 += cnt
        n_ag1 += p1[:, :-1].numel()
        n_ag2 += p2[:, :-2].numel()
    model.train()
    mtp.train()
    out = {k: sums[k] / n0 for k in ("loss", "acc", "mtp_loss", "mtp_acc", "chain_loss", "chain_acc")}
    out["mtp_agree_target_greedy"] = sums["agree1"] / n_ag1
    out["chain_agree_target_greedy"] = sums["agree2"] / n_ag2
    out["tokens"] = n0
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in out.items()}


def hardware(device: torch.device) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    import tokenizers
    import transformers

    info["transformers"] = transformers.__version__
    info["tokenizers"] = tokenizers.__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.card_from is not None:
        out = args.out or DEFAULT_OUT
        write_model_card(out, json.loads(Path(args.card_from).read_text()))
        print(f"wrote {out / 'MODEL_CARD.md'}")
        return 0
    deadline = T_START + args.minutes * 60.0
    seed_everything(args.seed)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    amp = device.type == "cuda"
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the few fp32 matmuls (delta-rule solves stay fp32)
    command = "python tools/train_default_model.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    log(f"start: {command} | device {device} | budget {args.minutes} min | out {args.out}")

    # ---- corpus
    corpus = train_corpus.collect_corpus(
        code_cap_bytes=int(args.code_mb * 1e6), prose_cap_bytes=int(args.prose_mb * 1e6), seed=args.seed, log=log
    )
    t_corpus = time.time() - T_START

    # ---- tokenizer
    sample = tokenizer_sample(corpus.train, args.tok_sample_mb * 1e6, args.seed)
    log(
        f"tokenizer: training BPE (vocab {args.vocab}) on {len(sample)} docs, {sum(map(len, sample)) / 1e6:.1f} M chars"
    )
    tok, enc_train, counts = tt.build_tokenizer([d.text for d in corpus.train], sample, args.vocab, log=log)
    tok_json = tt.tokenizer_json(tok)
    enc_held = tt.encode_docs(tok, [d.text for d in corpus.heldout])
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    train_stream = pack(enc_train)
    held_stream = pack(enc_held)
    t_tok = time.time() - T_START
    cum = np.cumsum(np.sort(counts)[::-1]) / max(1, counts.sum())
    tok_stats = {
        "vocab_size": vocab_size,
        "train_tokens": int(train_stream.size),
        "heldout_tokens": int(held_stream.size),
        "bpe_training_docs": len(sample),
        "bpe_training_chars": int(sum(map(len, sample))),
        "chars_per_token_train": round(sum(len(d.text) for d in corpus.train) / max(1, int(counts.sum())), 3),
        "first_n_ids_coverage": {
            str(n): round(float(counts[:n].sum() / max(1, counts.sum())), 4)
            for n in (256 + 1, 1024, 2048, 4096, 8192, vocab_size)
            if n <= vocab_size
        },
        "top_n_coverage_sorted": {str(n): round(float(cum[n - 1]), 4) for n in (1024, 4096) if n <= vocab_size},
    }
    log(f"tokenizer: train stream {train_stream.size} tokens, held-out {held_stream.size} tokens")

    # ---- model
    cfg = tm.config_dict(vocab_size, **model_shape(args))
    model = tm.build_target(cfg, args.seed)
    hf_cfg = model.config
    torch.manual_seed(args.seed + 1)
    mtp = tm.MTPHead(hf_cfg)
    model.to(device).train()
    mtp.to(device).train()
    params = tm.param_count(model, mtp)
    log(f"model: {params}")
    decay, no_decay = [], []
    for mod in (model, mtp):
        for p in mod.parameters():
            (decay if p.ndim == 2 else no_decay).append(p)
    opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if device.type == "cuda":
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], **opt_kwargs
    )

    stream_dev = torch.from_numpy(train_stream.astype(np.int32)).to(device)
    held_dev = torch.from_numpy(held_stream.astype(np.int32)).to(device)
    batches = Batches(stream_dev, args.seq, args.batch, args.seed)
    reserve = 30.0 if device.type == "cuda" else 12.0  # evaluation + export + checks
    train_deadline = deadline - reserve
    chain = args.mtp_chain_weight > 0

    # ---- training
    step, total_steps, warmup = 0, args.max_steps or 10**9, args.warmup
    t_train0 = time.time()
    t_measure0 = None
    ema = None
    last_print = 0.0
    history = []
    while step < total_steps:
        now = time.time()
        if now >= train_deadline:
            log(f"train: budget reached at step {step}")
            break
        if step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_measure0 = time.time()
        if step == 30:
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = (time.time() - t_measure0) / (step - 10)
            est = step + int((train_deadline - time.time()) / step_s * 0.97)
            if args.max_steps:
                est = min(est, args.max_steps)
            total_steps = max(est, step + 1)
            warmup = min(warmup, max(1, total_steps // 5))
            log(
                f"train: {step_s * 1000:.0f} ms/step -> planning {total_steps} steps "
                f"({total_steps * args.batch * args.seq / 1e6:.0f} M tokens)"
            )
        lr = tm.lr_at(step, total_steps, args.lr, warmup, args.final_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        w = batches.next()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            (l0, l1, l2), (t0, t1, t2) = tm.forward_all(model, mtp, w, chain=chain)
            loss0 = tm.ce(l0, t0)
            loss1 = tm.ce(l1, t1)
            loss = loss0 + args.mtp_weight * loss1
            loss2 = None
            if chain:
                loss2 = tm.ce(l2, t2)
                loss = loss + args.mtp_chain_weight * loss2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(mtp.parameters()), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1 or time.time() - last_print > 15:
            vals = [loss0.item(), loss1.item(), loss2.item() if loss2 is not None else 0.0]
            ema = vals if ema is None else [0.9 * e + 0.1 * v for e, v in zip(ema, vals)]
            if time.time() - last_print > (15 if device.type == "cuda" else 5) or step == 1:
                last_print = time.time()
                el = time.time() - t_train0
                tps = step * args.batch * args.seq / max(el, 1e-9)
                log(
                    f"step {step}/{total_steps if total_steps < 10**9 else '?'} lr {lr:.2e} loss {vals[0]:.3f} "
                    f"mtp {vals[1]:.3f} chain {vals[2]:.3f} gnorm {float(gnorm):.2f} epoch {batches.epochs:.2f} "
                    f"{tps / 1e3:.0f} k tok/s"
                )
                history.append(
                    {
                        "step": step,
                        "elapsed_s": round(el, 1),
                        "lr": lr,
                        "loss": round(vals[0], 4),
                        "mtp_loss": round(vals[1], 4),
                        "chain_loss": round(vals[2], 4),
                    }
                )
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train0
    log(f"train: {step} steps in {train_s:.1f} s")

    # ---- evaluation on exactly the exported (bf16-rounded) weights
    tm.round_to_bf16_(model, mtp)
    held_w = eval_windows(held_dev, args.seq, args.eval_seqs)
    train_w = eval_windows(stream_dev, args.seq, args.eval_seqs)
    ev_held = evaluate(model, mtp, held_w, args.batch, amp)
    ev_train = evaluate(model, mtp, train_w, args.batch, amp)
    log(f"eval held-out: {ev_held}")
    log(f"eval train:    {ev_train}")

    # ---- export + checks
    out = Path(args.out)
    index = tm.export_model(out, model, mtp, cfg, tok_json)
    check = tm.verify_export(out, model, mtp, held_w[:2, : min(args.seq, 256) + 3].cpu())
    log(f"export: {out} verified {check}")
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != "MODEL_CARD.md"}
    total_s = time.time() - T_START
    metrics = {
        "name": "specdeck-tiny",
        "command": command,
        "seed": args.seed,
        "smoke": args.smoke,
        "hardware": hardware(device),
        "config": cfg,
        "parameters": params,
        "corpus": corpus.stats,
        "tokenizer": tok_stats,
        "training": {
            "steps": step,
            "planned_steps": total_steps if total_steps < 10**9 else step,
            "batch_sequences": args.batch,
            "seq_len": args.seq,
            "tokens_per_step": args.batch * args.seq,
            "tokens_seen": step * args.batch * args.seq,
            "epochs": round(batches.epochs, 3),
            "lr_peak": args.lr,
            "warmup_steps": warmup,
            "final_lr_frac": args.final_lr_frac,
            "weight_decay": args.weight_decay,
            "betas": [0.9, 0.95],
            "grad_clip": 1.0,
            "mtp_weight": args.mtp_weight,
            "mtp_chain_weight": args.mtp_chain_weight,
            "precision": "bf16 autocast, fp32 master weights" if amp else "fp32",
            "train_seconds": round(train_s, 1),
            "corpus_seconds": round(t_corpus, 1),
            "tokenizer_seconds": round(t_tok - t_corpus, 1),
            "total_seconds": round(total_s, 1),
            "budget_minutes": args.minutes,
            "final_train_losses_ema": ema,
            "history": history,
        },
        "eval_heldout": ev_held,
        "eval_train": ev_train,
        "export_check": check,
        "files": files,
        "total_size_bytes_without_card": sum(files.values()),
        "index_total_size": index["metadata"]["total_size"],
        "log": LOG,
    }
    if args.metrics:
        Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        Path(args.metrics).write_text(json.dumps(metrics, indent=2) + "\n")
    if not args.no_card:
        write_model_card(out, metrics)
    log(f"done in {total_s:.1f} s")
    return 0


def write_model_card(out: Path, m: dict) -> None:
    c, p, tr, eh, et = m["config"], m["parameters"], m["training"], m["eval_heldout"], m["eval_train"]
    cs, ts, hw = m["corpus"], m["tokenizer"], m["hardware"]
    size_mb = (m["total_size_bytes_without_card"]) / 1e6
    lt = ", ".join("linear" if t == tm.LINEAR else "full" for t in c["layer_types"])
    gpu = hw.get("gpu") or "CPU only"
    how = (
        "The run that produced these files (its output directory and metrics file pointed at the training "
        "machine's scratch space;\nthe card was written afterwards from the metrics with `--card-from`):"
        if "--no-card" in m["command"]
        else "The run that produced these files:"
    )
    mins = tr["total_seconds"] / 60
    card = f"""# specdeck-tiny

SpecDeck's bundled default model: a small Qwen3.5-architecture hybrid (gated delta-net + gated attention) with one
MTP (multi-token prediction) draft layer, trained from scratch by `tools/train_default_model.py` on text that every
Python installation has locally. It exists so that the app, `specdeck generate` and `specdeck bench` run out of the
box and show real speculative-decoding acceptance; it is not a useful language model.

## Architecture
| | |
|---|---|
| class | `Qwen3_5ForCausalLM` (`model_type: qwen3_5_text`) + 1 MTP layer (`mtp.*`, ignored by transformers) |
| layers | {len(c["layer_types"])}: {lt} |
| hidden / intermediate | {c["hidden_size"]} / {c["intermediate_size"]} (SiLU-gated MLP) |
| full attention | {c["num_attention_heads"]} query heads x {c["head_dim"]}, {c["num_key_value_heads"]} KV heads (GQA), output gate, q/k norm, partial RoPE {c["rope_parameters"]["partial_rotary_factor"]} (theta {c["rope_parameters"]["rope_theta"]:g}) |
| gated delta-net | {c["linear_num_key_heads"]} key heads x {c["linear_key_head_dim"]}, {c["linear_num_value_heads"]} value heads x {c["linear_value_head_dim"]}, conv kernel {c["linear_conv_kernel_dim"]} |
| norms | zero-centred RMSNorm (scale 1 + w), eps {c["rms_norm_eps"]:g} |
| vocabulary | {c["vocab_size"]} (byte-level BPE), embeddings tied to the output layer |
| MTP | `mtp.fc` [H, 2H], `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm`, `mtp.layers.0.*` (one full-attention decoder layer) |
| parameters | {p["total"]:,} in all: target {p["target"]:,} (embedding {p["embedding"]:,}), MTP {p["mtp"]:,} |
| weights | bf16 safetensors, {len([f for f in m["files"] if f.endswith(".safetensors")])} shards of at most 15 MiB + `model.safetensors.index.json`; {size_mb:.1f} MB on disk with the tokenizer and configs |
| special token | `<\\|endoftext\\|>` = id 0: end of text, EOS and BOS (`eos_token_id` = `bos_token_id` = 0); documents were separated by it in training; no BOS is added by the tokenizer |

Tensor names are those of the real checkpoints: `model.language_model.*` (transformers maps them to `model.*`),
no `lm_head.weight` (tied), and `mtp.*`. `Qwen3_5ForCausalLM.from_pretrained(dir, dtype=torch.float32)` loads the
target part with no missing keys; the run checked that its logits equal the trained model's (max abs difference
{m["export_check"]["max_abs_logit_diff_target"]:.2e}; MTP {m["export_check"]["max_abs_logit_diff_mtp"]:.2e}).

### MTP semantics (what was trained; the engine implements the same)
For row r: `e = pre_fc_norm_embedding(embed(tok[r+1]))`, `hn = pre_fc_norm_hidden(h[r])` where `h[r]` is the
target's hidden state after its final norm at position r; `x = fc(cat([e, hn]))` (embedding first);
`x = mtp.layers.0(x)` with causal attention over the MTP rows 0..r and RoPE position r; `y = mtp.norm(x)`;
`logits = lm_head(y)` predict `tok[r+2]`. A chained draft step feeds `y` back as the hidden with the drafted token,
one position further on, attending to the MTP rows 0..r and itself; training included that step with weight
{tr["mtp_chain_weight"]} (loss = CE(next) + {tr["mtp_weight"]} CE(MTP) + {tr["mtp_chain_weight"]} CE(chained MTP)).

## Tokenizer
Byte-level BPE (`tokenizers`, ByteLevel pre-tokenizer and decoder), {ts["vocab_size"]} ids, trained on
{ts["bpe_training_docs"]} training documents ({ts["bpe_training_chars"] / 1e6:.1f} M characters). Ids are re-numbered
after training: `<|endoftext|>` = 0, the 256 single-byte tokens = 1 + byte value, then all other tokens by descending
frequency on the training corpus, so the first N ids are the N most common tokens (the sub-vocab knob). Coverage of
the training tokens by the first N ids: {", ".join(f"{k}: {v:.1%}" for k, v in ts["first_n_ids_coverage"].items())}.
{ts["chars_per_token_train"]} characters per token on the training corpus. Training the tokenizer twice from the same
corpus gives a byte-identical `tokenizer.json`.

## Corpus
Python source of the standard library and the installed packages (code) and their markdown / reST / text files plus
the docstrings of Python files not taken as code (prose), found locally on the training machine (roots:
{"; ".join(cs["roots"])}); no downloads. Files of 128 B .. 256 KiB that decode as UTF-8, no line over 1000 chars;
deduplicated by SHA-256 of the content ({cs["duplicates_dropped"]} duplicates dropped); capped at
{cs["code_cap_bytes"] / 1e6:.1f} MB code + {cs["prose_cap_bytes"] / 1e6:.1f} MB prose, picked by a hash of the path
(a deterministic sample across packages); held-out split by file: blake2b(path) mod {cs["heldout_mod"]} == 0.
| | documents | MB | tokens |
|---|---|---|---|
| train | {cs["train_docs"]} | {cs["train_bytes"] / 1e6:.1f} (code {cs["train_code_bytes"] / 1e6:.1f}, prose {cs["train_prose_bytes"] / 1e6:.1f}) | {ts["train_tokens"]:,} |
| held-out | {cs["heldout_docs"]} | {cs["heldout_bytes"] / 1e6:.1f} | {ts["heldout_tokens"]:,} |

## Training
AdamW (betas 0.9/0.95, weight decay {tr["weight_decay"]} on matrices, gradient clip 1.0), peak LR {tr["lr_peak"]:g},
{tr["warmup_steps"]} warm-up steps then cosine to {tr["final_lr_frac"]:g} of the peak, {tr["precision"]}, seed {m["seed"]}.
Sequences of {tr["seq_len"]} tokens cut from the packed stream (documents joined by `<|endoftext|>`), {tr["batch_sequences"]}
per step ({tr["tokens_per_step"]:,} tokens). {tr["steps"]} steps, {tr["tokens_seen"] / 1e6:.1f} M tokens
({tr["epochs"]:.2f} epochs). The step count comes from the wall-clock budget: after 30 steps the script measures the step
time and plans the cosine schedule to end inside the budget.

Ran on {gpu} ({hw["platform"]}; Python {hw["python"]}, torch {hw["torch"]}, transformers {hw["transformers"]},
tokenizers {hw["tokenizers"]}, {hw["cpu_count"]} CPU cores): {mins:.1f} minutes in all (corpus {tr["corpus_seconds"]:.0f} s,
tokenizer and encoding {tr["tokenizer_seconds"]:.0f} s, training {tr["train_seconds"]:.0f} s, evaluation and export the rest).

## Results (bf16 weights as exported, {eh["tokens"]:,} tokens of each split)
| | train sample | held-out |
|---|---|---|
| next-token loss | {et["loss"]:.3f} | {eh["loss"]:.3f} |
| next-token accuracy | {et["acc"]:.1%} | {eh["acc"]:.1%} |
| MTP loss (token after next) | {et["mtp_loss"]:.3f} | {eh["mtp_loss"]:.3f} |
| MTP accuracy (token after next) | {et["mtp_acc"]:.1%} | {eh["mtp_acc"]:.1%} |
| chained MTP accuracy (third token) | {et["chain_acc"]:.1%} | {eh["chain_acc"]:.1%} |
| MTP argmax = target's own greedy choice | {et["mtp_agree_target_greedy"]:.1%} | {eh["mtp_agree_target_greedy"]:.1%} |
| chained MTP argmax = target's greedy choice | {et["chain_agree_target_greedy"]:.1%} | {eh["chain_agree_target_greedy"]:.1%} |

(Teacher-forced figures on real text. "= target's greedy choice" is the per-token acceptance greedy speculative
decoding would see for the first / second draft token given an accepted prefix; the engine's bench measures the real
acceptance on the SpecDeck workloads.)

## Reproduce
{how}
```
{m["command"]}
```
Into the repository directly: `python tools/train_default_model.py --minutes {tr["budget_minutes"]:g} --out assets/models/specdeck-tiny`
(on the machine above; another machine has other installed packages, hence another corpus and another model.
`--smoke` runs the whole pipeline on a CPU in about a minute. The metrics of the run, including its log, follow.)

<details><summary>metrics of the run</summary>

```json
{json.dumps({k: v for k, v in m.items() if k != "log"}, indent=1)}
```

```
{chr(10).join(m.get("log", []))}
```
</details>
"""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "MODEL_CARD.md").write_text(card)


if __name__ == "__main__":
    sys.exit(main())
