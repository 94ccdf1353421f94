#!/usr/bin/env python3
"""torch peer of the README's GPU job (examples/train_char_lm): the same character-level model, the same config file,
the same corpus, on one GPU, timed the same way, so the two run in one command (bench/char_lm/run_char_lm_bench.sh).

    python3 bench/peers/char_lm_peer.py --config examples/configs/char_lm_gpu.json --mode eager --json OUT.jsonl

The model (examples/char_lm.h): ids [context, batch] with id = t·vocab_padded + char at position t; an embedding table
[context·vocab_padded, hidden] (normal, std 1/√context); x = Σ_t table[ids[t]] → [batch, hidden]; `layers` residual
blocks x = x + fc2(gelu_tanh(fc1(x))) (fc1 hidden→ffn, fc2 ffn→hidden, with bias); a head Linear(hidden →
vocab_padded) and the mean cross-entropy against the next character. AdamW (torch's fused kernel) with the config's
lr, weight decay (on every parameter, as shardline's AdamW) and linear warmup. Parameters are fp32 with bf16 autocast
(dtype bf16) — how a torch user trains this model; batches are drawn on the GPU (random windows of the corpus held on
the device), so the host never stalls the step.

Modes:
  eager         nn.Embedding then a sum over the positions (materialises [context, batch, hidden])
  embeddingbag  nn.EmbeddingBag(mode="sum"): the fused gather-sum
  compile       the eager model under torch.compile (default mode); the first steps compile, and are excluded

Timing as train_char_lm's progress line: steps `--skip`+1 .. `steps` (default: the config's steps; the first 10 are
warm-up), CUDA-synchronised wall clock over the window, ms/step = window / steps; also the median of per-step CUDA
event times. tokens/s = predictions/s = batch / (ms/step); TFLOP/s = 3 · FLOPs per prediction · batch / t with FLOPs
per prediction = 2·(layers·2·hidden·ffn + hidden·vocab_padded) (shardline's CharLM::FlopsPerPrediction); peak GPU
memory = torch.cuda.max_memory_allocated. One JSON line per mode to --json; a line on stdout.
"""

import argparse
import datetime
import glob
import json
import math
import os
import sys
import time

from peer_util import commit, no_nvlink_multicast, percentile

no_nvlink_multicast("char_lm_peer")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def load_config(path):
    with open(path) as f:
        c = json.load(f)
    defaults = {"steps": 50, "context": 32, "hidden": 2048, "ffn": 8192, "layers": 4, "batch": 8192, "lr": 1e-3,
                "warmup_steps": 0, "weight_decay": 0.01, "dtype": "bf16", "seed": 1234,
                "data": "/usr/share/common-licenses"}
    for k, v in defaults.items():
        c.setdefault(k, v)
    return c


def read_corpus(path):
    """The bytes of every regular file of the directory in sorted order (examples/char_lm.cc's ReadCorpus)."""
    files = sorted(p for p in glob.glob(os.path.join(path, "*")) if os.path.isfile(p)) if os.path.isdir(path) else [path]
    text = b"".join(open(p, "rb").read() for p in files)
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = [index[ch] for ch in text]
    split = int(len(ids) * 0.9)
    return ids, split, len(vocab)


class CharLM(nn.Module):
    def __init__(self, c, vocab_padded, bag):
        super().__init__()
        self.context = c["context"]
        self.vocab_padded = vocab_padded
        rows = c["context"] * vocab_padded
        std = 1.0 / math.sqrt(c["context"])
        if bag:
            self.embedding = nn.EmbeddingBag(rows, c["hidden"], mode="sum")
        else:
            self.embedding = nn.Embedding(rows, c["hidden"])
        nn.init.normal_(self.embedding.weight, 0.0, std)
        self.bag = bag
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(c["hidden"], c["ffn"]), nn.GELU(approximate="tanh"), nn.Linear(c["ffn"], c["hidden"]))
            for _ in range(c["layers"]))
        self.head = nn.Linear(c["hidden"], vocab_padded)
        offsets = torch.arange(c["context"]).unsqueeze(1) * vocab_padded
        self.register_buffer("offsets", offsets, persistent=False)

    def forward(self, chars):  # chars [context, batch] (character ids)
        ids = chars + self.offsets
        if self.bag:
            x = self.embedding(ids.t().contiguous())  # [batch, context] bags -> [batch, hidden]
        else:
            x = self.embedding(ids).sum(0)  # [context, batch, hidden] -> [batch, hidden]
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--mode", choices=["eager", "embeddingbag", "compile"], default="eager")
    p.add_argument("--steps", type=int, help="default: the config's")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps excluded from the timing (default 10)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    p.add_argument("--json", help="append one JSON line here")
    a = p.parse_args()
    c = load_config(a.config)
    steps = a.steps or c["steps"]
    if steps <= a.skip:
        sys.exit(f"char_lm_peer: --steps ({steps}) must exceed --skip ({a.skip})")
    torch.manual_seed(c["seed"])
    dev = torch.device("cuda")
    ids, split, vocab = read_corpus(c["data"])
    vocab_padded = vocab  # shardline no longer pads the vocabulary (tp splits it unevenly, as torch.chunk)
    corpus = torch.tensor(ids, dtype=torch.int64, device=dev)
    model = CharLM(c, vocab_padded, bag=a.mode == "embeddingbag").to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=c["weight_decay"], fused=True)
    step_fn_model = torch.compile(model) if a.mode == "compile" else model
    amp = c["dtype"] in ("bf16", "bfloat16", "auto")
    context, batch = c["context"], c["batch"]
    window = torch.arange(context + 1, device=dev)

    def draw():
        starts = torch.randint(0, split - context - 1, (batch,), device=dev)
        w = corpus[starts.unsqueeze(0) + window.unsqueeze(1)]  # [context + 1, batch]
        return w[:context], w[context]

    def train_step(step):
        lr = c["lr"] * step / c["warmup_steps"] if 0 < step < c["warmup_steps"] else c["lr"]
        for g in opt.param_groups:
            g["lr"] = lr
        chars, labels = draw()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = step_fn_model(chars)
        loss = F.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    events = []
    losses = []
    torch.cuda.reset_peak_memory_stats()
    t0 = None
    for step in range(1, steps + 1):
        if step == a.skip + 1:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        loss = train_step(step)
        end.record()
        if step > a.skip:
            events.append((begin, end))
        if step in (1, steps) or step % 10 == 0:
            losses.append((step, float(loss)))
    torch.cuda.synchronize()
    timed = steps - a.skip
    ms = (time.perf_counter() - t0) * 1e3 / timed
    per_step = [b.elapsed_time(e) for b, e in events]
    flops = 2.0 * (c["layers"] * 2.0 * c["hidden"] * c["ffn"] + c["hidden"] * vocab_padded)
    tflops = 3.0 * flops * batch / (ms / 1e3) / 1e12
    rec = {
        "impl": "torch", "mode": a.mode, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "commit": commit(), "config": a.config, "steps": steps,
        "timed_steps": timed, "ms_per_step": ms, "ms_per_step_median": percentile(per_step, 0.5),
        "tokens_per_s": batch / (ms / 1e3), "tflops": tflops, "mfu": tflops / a.peak_tflops,
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "losses": losses,
    }
    print(f"char_lm_peer {a.mode:>12}: {ms:.2f} ms/step (median {rec['ms_per_step_median']:.2f}), "
          f"{rec['tokens_per_s']:.0f} tok/s, {tflops:.1f} TFLOP/s, MFU {100 * rec['mfu']:.1f} %, "
          f"peak {rec['peak_gpu_mem_gib']:.2f} GiB, loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}", flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
