"""Test tiers by marker: ``gpu`` tests skip without CUDA; ``slow``, ``tooling`` and ``calibration`` tests are
outside the default tier (scripts/test.sh) and run with ``scripts/test.sh --all``. The ``tooling`` and
``calibration`` markers are given here by file and test name, so that no test file needs to carry them."""
from __future__ import annotations

import pytest
import torch

# the launcher, benchmarks, scripts, demo, device scripts, README commands, CI and the presets' dry runs
TOOLING_FILES = {"test_launch.py", "test_benchmarks.py", "test_scripts.py", "test_device_scripts.py", "test_demo.py",
                 "test_ci.py", "test_presets.py", "test_megatron_lm.py", "test_megatron_lm_scripts.py",
                 "test_loss_parity.py"}
TOOLING_TESTS = {"test_launcher_passes_data_options", "test_readme_data_command_parses",
                 "test_launcher_command_parses_with_plugin_options", "test_help_prints"}
# the fitted constants and picks checked against the measured (or predicted) rows they were fitted on
CALIBRATION_TESTS = {"test_conversion_model_against_the_measured_steps", "test_mixer_pick_where_every_process_agrees",
                     "test_head_shard_price_fits_the_measured_rows", "test_cut_price_fits_the_measured_rows",
                     "test_core_price_fits_the_measured_rows", "test_the_pick_against_the_measured_kda_mixers",
                     "test_strategy_model_against_the_predicted_steps"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.originalname if hasattr(item, "originalname") else item.name
        if item.path.name in TOOLING_FILES or name in TOOLING_TESTS:
            item.add_marker(pytest.mark.tooling)
        if name in CALIBRATION_TESTS:
            item.add_marker(pytest.mark.calibration)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
