"""The training side of ``hf-sp-sft``: TRL's ``sft`` script with ``SPSFTTrainer`` (run in every worker process)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

LOCAL_DATA_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}


def load_sft_dataset(script_args, dataset_args):
    """What ``trl sft`` accepts: a hub name, a dataset mixture (``--datasets`` in a YAML config), or — in addition —
    a local json / jsonl / parquet / csv file or a folder of them."""
    from datasets import load_dataset
    from trl import get_dataset

    if dataset_args.datasets:
        return get_dataset(dataset_args)
    name = script_args.dataset_name
    path = Path(name)
    if path.is_file() and path.suffix in LOCAL_DATA_FORMATS:
        return load_dataset(LOCAL_DATA_FORMATS[path.suffix], data_files=str(path))
    return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


def train(script_args, training_args, model_args, dataset_args, trainer_cls=None, **trainer_kwargs) -> None:
    """Train as TRL's scripts (``trl sft``, ``trl dpo``, ...) do, with ``trainer_cls`` (default ``SPSFTTrainer``) and
    any further constructor arguments (GRPO / RLOO: ``reward_funcs``)."""
    from transformers import set_seed
    from trl import get_peft_config, get_quantization_config

    if trainer_cls is None:
        from hf_sp_trainer.trainers.sft import SPSFTTrainer as trainer_cls

    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    dataset = load_sft_dataset(script_args, dataset_args)
    set_seed(training_args.seed)  # before the model (and LoRA adapters) are created: reproducible runs
    eval_split = script_args.dataset_test_split
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[eval_split] if training_args.eval_strategy != "no" and eval_split in dataset else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        **trainer_kwargs,
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    trainer.accelerator.print(f"Model saved to {os.path.abspath(training_args.output_dir)}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.end()


def quiet_other_ranks() -> None:
    """One console: progress bars and library warnings from the main process only."""
    if int(os.environ.get("RANK", "0")) == 0:
        return
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()


def worker(argv: list[str]) -> None:
    """Entry point of each launched process: the main job's defaults when no model or data is given, then train."""
    from hf_sp_trainer.cli import main_job
    from hf_sp_trainer.cli.args import make_parser

    quiet_other_ranks()
    parser = make_parser()
    namespace, _, _ = parser.parse_namespace(argv)
    if main_job.is_requested(namespace):
        argv = main_job.default_argv(argv)
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
        argv, fail_with_unknown_args=False
    )
    if main_job.is_requested(script_args, model_args, dataset_args):
        main_job.run(training_args, model_args)
    else:
        train(script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    from hf_sp_trainer.topology.teardown import exit_finished_worker

    worker(sys.argv[1:])
    exit_finished_worker()
