"""``hf-sp-sft``: every ``trl sft`` flag is accepted, SP flags are documented, and a 2-process sp=2 LoRA run gives
the same per-step losses as the 1-process run (launched by hf-sp-sft itself, and in-process under torchrun)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.harness import tiny_model
from tests.sft_harness import sft_dataset

BIN = os.path.dirname(sys.executable)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _options(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", help_text))


def test_help_accepts_every_trl_sft_option():
    trl_help = subprocess.run([f"{BIN}/trl", "sft", "--help"], capture_output=True, text=True, env=ENV, check=True)
    ours = subprocess.run([f"{BIN}/hf-sp-sft", "--help"], capture_output=True, text=True, env=ENV, check=True)
    trl_options, our_options = _options(trl_help.stdout), _options(ours.stdout)
    assert len(trl_options) > 100
    assert trl_options <= our_options, sorted(trl_options - our_options)
    for flag in ("--sp_size", "--sp_attn_implementation", "--num_processes"):
        assert flag in our_options


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from hf_sp_trainer.data import build_char_tokenizer

    root = tmp_path_factory.mktemp("cli")
    tiny_model("llama").save_pretrained(root / "model")
    build_char_tokenizer().save_pretrained(root / "model")
    sft_dataset("prompt_completion", 12, seed=3).to_json(str(root / "data.jsonl"))
    common = [
        "--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "data.jsonl"),
        "--use_peft", "--lora_r", "4", "--lora_dropout", "0", "--lora_target_modules", "q_proj", "v_proj",
        "--max_steps", "3", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--logging_steps", "1",
        "--report_to", "none", "--bf16", "false", "--save_strategy", "no", "--seed", "0",
    ]  # fmt: skip

    def run(name, launcher, *flags):
        out = root / name
        cmd = [*launcher, *common, "--output_dir", str(out), *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        return [(e["loss"], e["grad_norm"]) for e in history if "grad_norm" in e]

    return run


def test_main_job_runs_end_to_end(tmp_path):
    """The built-in main job, shortened to 5 steps: trains under sp_size 2 and reports loss, accuracy, output."""
    done = subprocess.run(
        [f"{BIN}/hf-sp-sft", "--max_steps", "5", "--output_dir", str(tmp_path / "job")],
        capture_output=True, text=True, env=ENV, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "on 2 processes (sp_size=2)" in done.stdout
    assert re.search(r"eval loss: [\d.]+ -> [\d.]+", done.stdout)
    assert re.search(r"passkey retrieval accuracy: [\d.]+% of 8 held-out documents", done.stdout)
    assert (tmp_path / "job" / "model.safetensors").exists()


def test_cli_lora_sp2_matches_one_process(tiny_run):
    reference = tiny_run("sp1", [f"{BIN}/hf-sp-sft"], "--num_processes", "1", "--max_length", "none")
    launched = tiny_run("sp2", [f"{BIN}/hf-sp-sft"], "--num_processes", "2", "--sp_size", "2")
    torchrun = tiny_run("torchrun", [f"{BIN}/torchrun", "--nproc_per_node", "2", f"{BIN}/hf-sp-sft"], "--sp_size", "2",
                        "--use_cpu")  # fmt: skip
    assert len(reference) == 3
    for got in (launched, torchrun):
        for (loss, norm), (ref_loss, ref_norm) in zip(got, reference, strict=True):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
            assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm)
