"""The launched job of tests/test_preemption.py: a tiny SPTrainer run (sp_size 2, gloo, CPU, ``MAX_STEPS`` steps,
a checkpoint every ``SAVE_STEPS``) that records every step it trains and can be killed inside a save.

    torchrun --nproc_per_node 2 tests/preemption_job.py OUT [--resume true|PATH]

Environment:
- ``PREEMPTION_TEST_LAUNCH``: this launch's name, in every record;
- ``PREEMPTION_TEST_KILL=<point>:<rank>``: that rank SIGKILLs itself when its first save reaches ``point``:
  ``save_model:before`` (nothing of the model written), ``save_model:after`` (the model written, not the optimizer),
  ``marker:before`` (everything written by every rank, the completion marker not yet);
- ``PREEMPTION_TEST_STEP_SLEEP``: seconds each step lasts at least (a window for the test's signal).

Rank 0 appends one line per trained step to ``OUT/steps.jsonl`` (launch, step, loss, grad_norm); a run that reaches
``MAX_STEPS`` writes ``OUT/final.json`` (its log history) and ``OUT/final.pt`` (its parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

MAX_STEPS, SAVE_STEPS = 12, 4


def kill_point(name: str) -> None:
    if os.environ.get("PREEMPTION_TEST_KILL") == f"{name}:{os.environ.get('RANK')}":
        print(f"preemption_job: rank {os.environ.get('RANK')} SIGKILLs itself at {name}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume", default=None, help="true, or a checkpoint's path")
    opts = parser.parse_args()

    import torch
    from transformers import TrainerCallback

    from hf_sp_trainer.cli.main_job import build_model
    from hf_sp_trainer.data import build_char_tokenizer
    from hf_sp_trainer.trainers import preemption
    from hf_sp_trainer.trainers.arguments import TrainingArguments
    from hf_sp_trainer.trainers.base import SPTrainer

    launch = os.environ.get("PREEMPTION_TEST_LAUNCH", "job")
    step_sleep = float(os.environ.get("PREEMPTION_TEST_STEP_SLEEP", "0"))

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            time.sleep(step_sleep)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if args.process_index == 0 and logs and "loss" in logs:
                row = dict(launch=launch, step=state.global_step, loss=logs["loss"], grad_norm=logs["grad_norm"])
                with open(os.path.join(args.output_dir, "steps.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")

    class Job(SPTrainer):
        def save_model(self, output_dir=None, _internal_call=False):
            kill_point("save_model:before")
            super().save_model(output_dir, _internal_call)
            kill_point("save_model:after")

    write_marker = preemption.write_marker

    def marker_after_kill_point(*args, **kwargs):
        kill_point("marker:before")
        write_marker(*args, **kwargs)

    preemption.write_marker = marker_after_kill_point

    torch.manual_seed(0)
    model, tokenizer = build_model("sdpa"), build_char_tokenizer()
    words = [" ".join(["abc", "de", "fghij", "kl"][: i % 4 + 1] * (i % 5 + 2)) for i in range(2 * MAX_STEPS)]
    data = [{"input_ids": tokenizer(w)["input_ids"]} for w in words]
    args = TrainingArguments(
        output_dir=opts.out, max_steps=MAX_STEPS, save_strategy="steps", save_steps=SAVE_STEPS, logging_steps=1,
        report_to="none", disable_tqdm=True, use_cpu=True, ddp_backend="gloo", learning_rate=1e-2, seed=0,
        sp_size=2, per_device_train_batch_size=2, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Job(model=model, args=args, train_dataset=data, callbacks=[Record()])
    resume = {None: None, "true": True}.get(opts.resume, opts.resume)
    trainer.train(resume_from_checkpoint=resume)
    if trainer.state.global_step == MAX_STEPS and args.process_index == 0:
        with open(os.path.join(opts.out, "final.json"), "w") as f:
            json.dump({"log_history": trainer.state.log_history}, f)
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, os.path.join(opts.out, "final.pt"))


if __name__ == "__main__":
    main()
