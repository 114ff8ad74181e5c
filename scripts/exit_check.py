"""Does a finished run exit 0, every time, without ``trainer.end()``? Launch short 2-process runs and count.

    python scripts/exit_check.py --runs 30                       # every kind, 30 launches each
    python scripts/exit_check.py --runs 30 --load 1              # next to a busy process (one core spinning)
    python scripts/exit_check.py --kinds raise                   # a rank raising mid-training must fail, promptly
    python scripts/exit_check.py --runs 20 --load 2 --starve     # gloo's worker threads at the lowest CPU priority

Each launch is ``torchrun --nproc_per_node 2 scripts/exit_check.py --worker KIND``: a tiny model, two optimizer steps
(or one forward/backward for the trainer-free script), and the script simply ends (no ``trainer.end()``, no
``sp.remove()``, no ``destroy_process_group``), as the Hugging Face examples do. Kinds: ``trainer`` (SPTrainer),
``sft`` (SPSFTTrainer), ``dpo`` (SPDPOTrainer), ``grpo`` (SPGRPOTrainer), ``free`` (``apply_sequence_parallel``),
``plain`` (plain ``transformers.Trainer`` DDP, the baseline) and ``raise`` (SPTrainer whose rank 1 raises at step 2:
expected to exit non-zero, with the error shown). Prints the non-zero exits per kind and writes ``--out`` (JSON).

``--starve`` puts the workers' gloo threads (``pt_gloo_runloop``) in the idle scheduling class (``SCHED_IDLE``) once
the groups exist: beside ``--load`` busy processes they then run only when a core is free, which is what makes the
exit race of a busy node (``topology/teardown.py``) happen in most launches instead of now and then.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

KINDS = ("trainer", "sft", "dpo", "grpo", "free", "plain")


def _args(out_dir: str, **extra) -> dict:
    return dict(
        output_dir=out_dir, max_steps=2, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=True, ddp_backend="gloo", learning_rate=1e-3, **extra,
    )  # fmt: skip


def worker(kind: str, out_dir: str) -> None:
    import torch
    from datasets import Dataset

    from hf_sp_trainer.cli.main_job import build_model
    from hf_sp_trainer.data import build_char_tokenizer

    torch.manual_seed(0)
    model, tokenizer = build_model("sdpa"), build_char_tokenizer()
    words = [" ".join(["abc", "de", "fghij"] * (i % 5 + 2)) for i in range(16)]
    if kind == "free":
        import torch.distributed as dist

        from hf_sp_trainer import apply_sequence_parallel

        dist.init_process_group("gloo")
        sp = apply_sequence_parallel(model, 2)
        _starve_comm_threads()
        ids = torch.tensor([tokenizer(words[0])["input_ids"]])
        model(**sp.shard_batch({"input_ids": ids, "labels": ids})).loss.backward()
        return
    if kind in ("trainer", "plain", "raise"):
        import transformers

        from hf_sp_trainer import SPTrainer, TrainingArguments

        data = [{"input_ids": tokenizer(w)["input_ids"]} for w in words]
        if kind == "plain":
            args = transformers.TrainingArguments(**_args(out_dir), per_device_train_batch_size=2)
            collator = transformers.DataCollatorWithFlattening(return_position_ids=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
        else:
            args = TrainingArguments(**_args(out_dir), sp_size=2, per_device_train_batch_size=2)
            trainer = SPTrainer(model=model, args=args, train_dataset=data)
            if kind == "raise":
                trainer.add_callback(_raise_on_rank1())
    elif kind == "sft":
        from hf_sp_trainer import SFTConfig, SPSFTTrainer

        args = SFTConfig(**_args(out_dir), sp_size=2, per_device_train_batch_size=2, bf16=False, max_length=None)
        trainer = SPSFTTrainer(
            model=model, args=args, train_dataset=Dataset.from_list([{"text": w} for w in words]),
            processing_class=tokenizer,
        )  # fmt: skip
    elif kind == "dpo":
        from hf_sp_trainer import DPOConfig, SPDPOTrainer

        rows = [{"prompt": w + " ->", "chosen": " abc", "rejected": " de"} for w in words]
        args = DPOConfig(**_args(out_dir), sp_size=2, per_device_train_batch_size=2, bf16=False, max_length=None)
        trainer = SPDPOTrainer(
            model=model, ref_model=build_model("sdpa"), args=args, train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )  # fmt: skip
    elif kind == "grpo":
        from hf_sp_trainer import GRPOConfig, SPGRPOTrainer

        args = GRPOConfig(
            **_args(out_dir), sp_size=2, per_device_train_batch_size=2, num_generations=2, max_completion_length=8,
            bf16=False,
        )  # fmt: skip
        trainer = SPGRPOTrainer(
            model=model, reward_funcs=_length_reward, args=args,
            train_dataset=Dataset.from_list([{"prompt": w + " ->"} for w in words]), processing_class=tokenizer,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown kind {kind!r}: one of {KINDS + ('raise',)}")
    _starve_comm_threads()
    trainer.train()


def _starve_comm_threads() -> None:
    """With ``EXIT_CHECK_STARVE=1``: this process's gloo worker threads in ``SCHED_IDLE`` (Linux)."""
    if os.environ.get("EXIT_CHECK_STARVE") != "1":
        return
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "pt_gloo_runloop":
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def _length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _raise_on_rank1():
    """A callback whose rank 1 fails at the start of step 2."""
    import transformers

    class RaiseOnRank1(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1 and args.process_index == 1:
                raise RuntimeError("exit_check: rank 1 fails on purpose at step 2")

    return RaiseOnRank1()


def launch(kind: str, port: int, timeout: float, starve: bool = False, env: dict | None = None) -> dict:
    """One ``torchrun`` launch: its exit code, wall time, and whether a failure was shown (the error text)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    env["EXIT_CHECK_STARVE"] = "1" if starve else "0"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
        os.path.abspath(__file__), "--worker", kind,
    ]  # fmt: skip
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, output = "timeout", str(exc.stdout or "") + str(exc.stderr or "")
    return {
        "kind": kind, "rc": rc, "seconds": round(time.perf_counter() - start, 1),
        "aborted": "terminate called" in output, "error_shown": "fails on purpose" in output,
    }  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--load", type=int, default=0, help="busy processes spinning next to the launches")
    parser.add_argument("--starve", action="store_true", help="the workers' gloo threads at SCHED_IDLE")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default="exit_check.json")
    opts = parser.parse_args()
    if opts.worker:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            worker(opts.worker, tmp)
        return
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(opts.load)]
    for p in spinners:
        p.start()
    rows = []
    try:
        for kind in opts.kinds:
            for _ in range(opts.runs):
                rows.append(launch(kind, free_port(), opts.timeout, opts.starve))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop.set()
    summary = {
        kind: {
            "runs": sum(r["kind"] == kind for r in rows),
            "nonzero_exits": sum(r["kind"] == kind and r["rc"] != 0 for r in rows),
            "aborts": sum(r["kind"] == kind and r["aborted"] for r in rows),
        }
        for kind in opts.kinds
    }
    setting = f"load: {opts.load} busy process(es), starve: {opts.starve}"
    print(f"{'kind':8} {'runs':>5} {'non-zero exits':>15} {'aborts':>7}   ({setting})")
    for kind, s in summary.items():
        print(f"{kind:8} {s['runs']:>5} {s['nonzero_exits']:>15} {s['aborts']:>7}")
    with open(opts.out, "w") as f:
        json.dump({"load": opts.load, "starve": opts.starve, "summary": summary, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
