"""The sharded learner on 4 CPU devices: steps equal one device, bytes per device, resharding resume.

JAX fixes the CPU device count when it initializes and this suite runs on one device, so the
checks run in a child process (tests/learner/sharded_checks.py sets jax_num_cpu_devices=4).
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(os.path.dirname(__file__), "sharded_checks.py")


def run_checks(*names: str) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, SCRIPT, *names], env=env, capture_output=True, text=True,
                          timeout=1800)
    done = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert proc.returncode == 0 and done == list(names), (
        f"checks {names} -> exit {proc.returncode}, passed {done}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def test_grpo_steps_on_meshes_equal_one_device_and_checkpoint_reshards():
    # (fsdp 2, tensor 2) and (data 2, fsdp 2): 3 steps across a controller change, no recompile;
    # per-device bytes; a checkpoint saved on fsdp 2 restores on 1 device and on tensor 2;
    # chunked log-probs on (fsdp 2, tensor 2) equal whole logits on one device.
    run_checks("grpo_fsdp_tensor", "grpo_data_fsdp", "bytes_per_device", "checkpoint_reshards",
               "chunked_logprobs_same_result")


def test_packed_grpo_steps_on_a_mesh_equal_one_device():
    run_checks("grpo_packed_data_fsdp")


def test_lora_steps_on_a_mesh_equal_one_device():
    # adapters sharded like their kernels' axes, the frozen base an argument with its own layout
    run_checks("lora_fsdp_tensor")


def test_lora_warm_up_and_ppo_on_a_mesh_equal_one_device():
    run_checks("lora_ppo_and_warm_up_fsdp_tensor")


@pytest.mark.slow
def test_ppo_steps_on_meshes_equal_one_device():
    run_checks("ppo_fsdp_tensor", "ppo_data_fsdp")


@pytest.mark.slow
def test_mixed_precision_and_remat_on_a_mesh():
    run_checks("bf16_params_fp32_moments", "remat_same_result")
