#!/usr/bin/env python3
"""train_char_lm's checkpoints (issue 17), end to end through mpiexec.

  char_lm_checkpoint_test.py exact   --work DIR --exe train_char_lm --tool shardline-ckpt -- MPIEXEC ARGS...
  char_lm_checkpoint_test.py reshard --work DIR --exe train_char_lm --tool shardline-ckpt -- MPIEXEC ARGS...

exact:   8 steps on tp 2 (async saves at 3, 6, 8) == 4 steps + save + load + 4 steps: the losses of steps 5..8 and
         the final weights and optimizer state bitwise equal (shardline-ckpt diff), the resumed run's progress lines
         numbered 5..8.
reshard: saves after step 4 of 8 on dp x tp = 1x2 and 2x2, loaded on 1x1, 1x4 and 2x1: training goes on with the
         losses of steps 5..8 within fp32 rounding (rtol 1e-5) of the uninterrupted run; then the 2x2 checkpoint
         exported to safetensors is read back by the independent reader below (json + struct only) and compared with
         the full tensors assembled, also independently, from metadata.json and the rank files.
crash:   a job killed (SHARDLINE_TEST_CRASH_BEFORE_COMMIT_STEP) between the writes and the commit of its second save:
         `latest` still names the first, the partial one is listed by shardline-ckpt inspect as uncommitted, and a
         run loaded from the root resumes from the first with bitwise the losses of the uninterrupted run.
moe:     MoE blocks (4 experts, top-2, no aux loss: it is per rank, so it changes with the data-parallel split) saved
         after step 4 of 8 on dp x ep x tp = 1x2x2 (4 ranks), loaded on 1x2x1 (2 ranks), 1x4x1 and 1x1x1: the losses
         of steps 5..8 within rtol 1e-5 of the uninterrupted run; the same mesh resumes bitwise.
keep:    --save-keep-last 2 with saves every 2 steps of 9 (steps 2, 4, 6, 8, 9), synchronous and --async-save: exactly
         the last two step directories remain, `latest` names the newest, no temporary is left, and it loads.
MPIEXEC ARGS is the launcher without -n (e.g. mpiexec --oversubscribe --bind-to none --timeout 120).
"""
import json
import os
import shutil
import struct
import subprocess
import sys

ARGS = ["--context", "8", "--hidden", "32", "--ffn", "64", "--layers", "1", "--batch", "32", "--log-interval", "1",
        "--eval-interval", "1000", "--sample-chars", "0"]


def run(launcher, exe, np, extra, env=None, expect_failure=False):
    cmd = launcher + ["-n", str(np), exe] + ARGS + extra
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=dict(os.environ, **(env or {})))
    if expect_failure:
        check(proc.returncode != 0, f"expected a failure: {' '.join(cmd)}\n{proc.stdout}")
        return proc.stdout
    if proc.returncode != 0:
        sys.exit(f"FAILED ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}")
    return proc.stdout


def losses(path):
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]
    return out


def progress_steps(stdout):
    return [int(line.split()[1].split("/")[0]) for line in stdout.splitlines() if line.startswith("step ")]


def check(cond, message):
    if not cond:
        sys.exit("FAILED: " + message)


def exact(work, exe, tool, launcher):
    full = os.path.join(work, "full.jsonl")
    resumed = os.path.join(work, "resumed.jsonl")
    # The uninterrupted run saves asynchronously every 3 steps (the writes overlap steps 4..6), then after step 8.
    run(launcher, exe, 2, ["--tp", "2", "--steps", "8", "--metrics", full, "--save", os.path.join(work, "full"),
                           "--save-interval", "3", "--async-save"])
    run(launcher, exe, 2, ["--tp", "2", "--steps", "4", "--metrics", os.path.join(work, "first.jsonl"),
                           "--save", os.path.join(work, "part"), "--save-interval", "2"])
    out = run(launcher, exe, 2, ["--tp", "2", "--steps", "8", "--metrics", resumed, "--load",
                                 os.path.join(work, "part"), "--save", os.path.join(work, "part")])
    check(progress_steps(out) == [5, 6, 7, 8], f"the resumed run logged steps {progress_steps(out)}, not 5..8")
    a, b = losses(full), losses(resumed)
    for step in range(5, 9):
        check(a[step] == b[step], f"step {step}: loss {b[step]!r} after the resume, {a[step]!r} without (bitwise)")
    diff = subprocess.run([tool, "diff", os.path.join(work, "full"), os.path.join(work, "part")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(diff.stdout)
    check(diff.returncode == 0, "the weights and optimizer state after 8 steps differ between the runs")
    print("exact resume: steps 5..8 and the final state bitwise equal")


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {name: (h["dtype"], h["shape"], data[h["data_offsets"][0]:h["data_offsets"][1]])
            for name, h in header.items()}


SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8}
SAFE = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64"}


def assemble(ckpt_dir):
    """Every tensor, full, from metadata.json and the rank files: the shards' boxes copied row by row."""
    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        meta = json.load(f)
    out = {}
    for name, t in meta["tensors"].items():
        elem = SIZES[t["dtype"]]
        shape = t["shape"]
        total = 1
        for d in shape:
            total *= d
        full = bytearray(total * elem)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        for s in t["shards"]:
            with open(os.path.join(ckpt_dir, s["file"]), "rb") as f:
                f.seek(s["byte_offset"])
                blob = f.read(s["length"])
            sshape = s["shape"]
            row = sshape[-1] * elem if sshape else elem
            rows = s["length"] // row if row else 0
            for r in range(rows):
                # the global index of row r's first element
                idx, rem = [], r
                for d in range(len(sshape) - 2, -1, -1):
                    idx.insert(0, rem % sshape[d])
                    rem //= sshape[d]
                g = sum((s["offset"][d] + idx[d]) * strides[d] for d in range(len(sshape) - 1))
                g += s["offset"][-1] if sshape else 0
                full[g * elem:g * elem + row] = blob[r * row:(r + 1) * row]
        out[name] = (SAFE[t["dtype"]], shape, bytes(full))
    return out


def reshard(work, exe, tool, launcher):
    saves = {"1x2": (2, ["--dp", "1", "--tp", "2"]), "2x2": (4, ["--dp", "2", "--tp", "2"])}
    loads = {"1x1": (1, ["--dp", "1", "--tp", "1"]), "1x4": (4, ["--dp", "1", "--tp", "4"]),
             "2x1": (2, ["--dp", "2", "--tp", "1"])}
    worst = 0.0
    for sname, (snp, sflags) in saves.items():
        ref = os.path.join(work, f"ref_{sname}.jsonl")
        root = os.path.join(work, f"save_{sname}")
        run(launcher, exe, snp, sflags + ["--steps", "8", "--metrics", ref])
        run(launcher, exe, snp, sflags + ["--steps", "4", "--metrics", os.path.join(work, f"first_{sname}.jsonl"),
                                          "--save", root])
        a = losses(ref)
        for lname, (lnp, lflags) in loads.items():
            got = os.path.join(work, f"resumed_{sname}_to_{lname}.jsonl")
            out = run(launcher, exe, lnp, lflags + ["--steps", "8", "--metrics", got, "--load", root])
            check(progress_steps(out) == [5, 6, 7, 8], f"{sname} -> {lname}: logged steps {progress_steps(out)}")
            b = losses(got)
            for step in range(5, 9):
                rel = abs(b[step] - a[step]) / abs(a[step])
                worst = max(worst, rel)
                check(rel <= 1e-5, f"{sname} -> {lname}: step {step} loss {b[step]} vs {a[step]} (rel {rel:.2e})")
            print(f"{sname} -> {lname}: steps 5..8 within 1e-5 of the uninterrupted run")
    print(f"reshard: max relative loss difference {worst:.2e}")

    # The safetensors export of the 2x2 checkpoint against the tensors assembled from the rank files.
    ckpt_dir = os.path.join(work, "save_2x2", "step_00000004")
    out = os.path.join(work, "model.safetensors")
    subprocess.run([tool, "export", os.path.join(work, "save_2x2"), "--format", "safetensors", out], check=True)
    exported = read_safetensors(out)
    assembled = assemble(ckpt_dir)
    check(sorted(exported) == sorted(assembled), "the export holds other tensors than metadata.json")
    for name, want in assembled.items():
        check(exported[name] == want, f"safetensors tensor {name} differs from the checkpoint's shards")
    print(f"safetensors: {len(exported)} tensors read back with json + struct, equal to the checkpoint")


def crash(work, exe, tool, launcher):
    """A job killed between the writes and the commit of its step-4 save leaves step 2 loadable."""
    root = os.path.join(work, "ckpt")
    ref = os.path.join(work, "ref.jsonl")
    run(launcher, exe, 2, ["--tp", "2", "--steps", "4", "--metrics", ref])
    run(launcher, exe, 2, ["--tp", "2", "--steps", "4", "--metrics", os.path.join(work, "killed.jsonl"), "--save",
                           root, "--save-interval", "2"], env={"SHARDLINE_TEST_CRASH_BEFORE_COMMIT_STEP": "4"},
        expect_failure=True)
    with open(os.path.join(root, "latest")) as f:
        check(f.read().strip() == "step_00000002", "latest moved to the uncommitted save")
    check(os.path.isdir(os.path.join(root, ".tmp_step_00000004")), "the killed save left no temporary directory")
    check(not os.path.exists(os.path.join(root, "step_00000004")), "the killed save was committed")
    inspect = subprocess.run([tool, "inspect", root], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(inspect.stdout)
    check(inspect.returncode == 0 and "uncommitted" in inspect.stdout and "step 2" in inspect.stdout,
          "shardline-ckpt inspect does not show step 2 as sound and the partial save as uncommitted")
    resumed = os.path.join(work, "resumed.jsonl")
    out = run(launcher, exe, 2, ["--tp", "2", "--steps", "4", "--metrics", resumed, "--load", root])
    check(progress_steps(out) == [3, 4], f"the resumed run logged steps {progress_steps(out)}, not 3..4")
    a, b = losses(ref), losses(resumed)
    for step in (3, 4):
        check(a[step] == b[step], f"step {step}: loss {b[step]!r} after the crash and resume, {a[step]!r} without")
    print("crash before commit: step 2 loaded, the partial save ignored, steps 3..4 bitwise")


def moe(work, exe, tool, launcher):
    """A MoE model saved on ep 2 x tp 2 resumes on ep 2, ep 4 and one rank (issue 17's "ep changes")."""
    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0"]
    root = os.path.join(work, "save_ep2_tp2")
    ref = os.path.join(work, "ref.jsonl")
    run(launcher, exe, 4, flags + ["--ep", "2", "--tp", "2", "--steps", "8", "--metrics", ref])
    run(launcher, exe, 4, flags + ["--ep", "2", "--tp", "2", "--steps", "4", "--metrics",
                                   os.path.join(work, "first.jsonl"), "--save", root])
    a = losses(ref)
    loads = {"ep2_tp2": (4, ["--ep", "2", "--tp", "2"]), "ep2": (2, ["--ep", "2"]), "ep4": (4, ["--ep", "4"]),
             "ep1": (1, ["--ep", "1"])}
    for lname, (lnp, lflags) in loads.items():
        got = os.path.join(work, f"resumed_{lname}.jsonl")
        out = run(launcher, exe, lnp, flags + lflags + ["--steps", "8", "--metrics", got, "--load", root])
        check(progress_steps(out) == [5, 6, 7, 8], f"ep2_tp2 -> {lname}: logged steps {progress_steps(out)}")
        check("saved on dp 1 x ep 2 x tp 2" in out, f"ep2_tp2 -> {lname}: the load line does not name the MoE mesh")
        b = losses(got)
        for step in range(5, 9):
            if lname == "ep2_tp2":
                check(a[step] == b[step], f"same mesh: step {step} loss {b[step]!r} vs {a[step]!r} (bitwise)")
            rel = abs(b[step] - a[step]) / abs(a[step])
            check(rel <= 1e-5, f"ep2_tp2 -> {lname}: step {step} loss {b[step]} vs {a[step]} (rel {rel:.2e})")
        print(f"ep2_tp2 -> {lname}: steps 5..8 within 1e-5 of the uninterrupted run")


def keep(work, exe, tool, launcher):
    """--save-keep-last 2: after saves at steps 2, 4, 6, 8 and 9 only step_8 and step_9 remain."""
    for mode, flags in (("sync", []), ("async", ["--async-save"])):
        root = os.path.join(work, mode)
        out = run(launcher, exe, 2, ["--tp", "2", "--steps", "9", "--metrics", os.path.join(work, mode + ".jsonl"),
                                     "--save", root, "--save-interval", "2", "--save-keep-last", "2"] + flags)
        saved = sorted(n for n in os.listdir(root) if n.startswith("step_"))
        check(saved == ["step_00000008", "step_00000009"], f"{mode}: kept {saved}, not the last two saves")
        others = sorted(n for n in os.listdir(root) if not n.startswith("step_") and n != "latest")
        check(others == [], f"{mode}: left {others} beside the checkpoints")
        with open(os.path.join(root, "latest")) as f:
            check(f.read().strip() == "step_00000009", f"{mode}: latest does not name step_00000009")
        for name in saved:
            check(os.path.isfile(os.path.join(root, name, "metadata.json")), f"{mode}: {name} has no metadata.json")
        starts = out.count("saved the checkpoint of step") + out.count("started the checkpoint of step")
        check(starts == 5, f"{mode}: expected 5 saves in the output, got {starts}:\n{out}")
        inspect = subprocess.run([tool, "inspect", root], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        check(inspect.returncode == 0 and "step 9" in inspect.stdout, f"{mode}: inspect failed:\n{inspect.stdout}")
        resumed = run(launcher, exe, 1, ["--steps", "10", "--metrics", os.path.join(work, mode + "_resumed.jsonl"),
                                         "--load", root])
        check(progress_steps(resumed) == [10], f"{mode}: the resume logged {progress_steps(resumed)}, not step 10")
        print(f"{mode}: --save-keep-last 2 kept {saved}, latest -> step_00000009, resumed at step 10")


def main():
    argv = sys.argv[1:]
    sep = argv.index("--")
    mode, rest, launcher = argv[0], argv[1:sep], argv[sep + 1:]
    opts = dict(zip(rest[0::2], rest[1::2]))
    work = opts["--work"]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    {"exact": exact, "reshard": reshard, "crash": crash, "moe": moe, "keep": keep}[mode](work, opts["--exe"], opts["--tool"], launcher)


if __name__ == "__main__":
    main()
