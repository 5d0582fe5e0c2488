"""Training on several processes: `torchrun --nproc_per_node 2` runs `spectune finetune` (QLoRA) and `spectune
draft --method kd` unchanged with DDP on the CPU (gloo), and matches one process fed the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

STEPS, GLOBAL_BATCH = 8, 8
SETTINGS = ["--max-steps", str(STEPS), "--lr", "5e-3", "--max-seq-length", "128", "--max-eval", "16"]
SETTINGS += ["--save-steps", "4"]


def spectune(args: list[str], processes: int, log: Path) -> None:
    """`spectune ARGS` in `processes` processes (torchrun with accelerate on the CPU), or plainly in one."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    command = [*(launcher if processes > 1 else [sys.executable]), "-m", "spectune.cli", *args]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "SPECTUNE_THREADS": "1"}
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=900).returncode
    assert code == 0, log.read_text()[-3000:]


def single_and_ddp(tmp_path: Path, stage: str, args: list[str], report: str) -> tuple[dict, dict, str]:
    """The stage run once in one process at the global batch, once in two at half of it each."""
    results, logs = [], ""
    for processes in (1, 2):
        out = tmp_path / f"{processes}-process"
        batch = ["--batch-size", str(GLOBAL_BATCH // processes)]
        spectune([stage, *args, *SETTINGS, *batch, "--out", str(out)], processes, tmp_path / f"{processes}.log")
        results.append(json.loads((out / report).read_text())["result"])
        logs = (tmp_path / f"{processes}.log").read_text()
        assert not list(out.rglob(".*.tmp-*")), "a rank left a half-written file"
    return results[0], results[1], logs


def check_ddp(single: dict, ddp: dict, log: str) -> None:
    for rank in (0, 1):
        assert f"rank {rank} of 2: {STEPS} optimizer steps" in log  # both ranks stepped
    assert single["steps"] == ddp["steps"] == STEPS
    # The same model on the same held-out set before training, split across the ranks and gathered (the eval loss
    # is a mean of batch means, and the ranks batch the dialogues otherwise: measured 0.2% apart for kd) ...
    assert ddp["eval_loss_before"] == pytest.approx(single["eval_loss_before"], rel=0.01)
    # ... and after the same number of updates of the same global batch; the ranks' shards draw the dialogues
    # in another order than one process does, so only the loss reached is compared.
    assert ddp["eval_loss_after"] == pytest.approx(single["eval_loss_after"], rel=0.05)
    assert ddp["eval_loss_after"] < ddp["eval_loss_before"]


def test_qlora_finetune_under_torchrun_ddp(micro_pair, demo_data, tmp_path):
    args = ["--model", str(micro_pair / "target"), "--data", str(demo_data)]
    single, ddp, log = single_and_ddp(tmp_path, "finetune", args, "finetune.json")
    check_ddp(single, ddp, log)
    adapter = tmp_path / "2-process" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and len(list(adapter.glob("*.safetensors"))) == 1


def test_kd_draft_under_torchrun_ddp(micro_pair, tuned_target, demo_data, tmp_path):
    args = ["--method", "kd", "--target", str(tuned_target), "--draft", str(micro_pair / "draft")]
    single, ddp, log = single_and_ddp(tmp_path, "draft", [*args, "--data", str(demo_data)], "draft.json")
    check_ddp(single, ddp, log)
    assert (tmp_path / "2-process" / "model" / "config.json").is_file()


@pytest.mark.parametrize("name", ["fsdp-qlora", "deepspeed-zero3-qlora", "ddp-cpu"])
def test_the_shipped_accelerate_configs_say_only_what_accelerate_launch_reads(name):
    """accelerate copies a config's keys onto its launch arguments by name and ignores the rest: a misspelt key
    would silently do nothing. Every key must be one `accelerate launch` has (or one of its config-file keys)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    path = Path(__file__).parents[1] / "configs" / "accelerate" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    known = {action.dest for action in launch_command_parser()._actions}
    known |= {"compute_environment", "distributed_type", "use_cpu"}  # read by the config loader itself
    keys = {key for key in yaml.safe_load(path.read_text()) if not key.endswith("_config")}
    keys |= set(config.fsdp_config or {}) | set(config.deepspeed_config or {})
    assert keys <= known, keys - known
