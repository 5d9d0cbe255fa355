"""Test set-up: the CUDA rules check, the ``gpu`` marker, the ``device_param`` marker, a fixed
seed per test, a fresh dynamo per compile test.

CUDA rules check (on by default): every ``torch._scaled_mm`` call a test makes is checked
against the rules of every supported NVIDIA build (``f8tensor.gemm.SCALED_MM_RULES``) and
a test that made an illegal call fails. Subprocesses (tutorials, benchmarks, the demo,
FSDP workers) inherit ``F8TENSOR_CHECK_CUDA_RULES=1`` and raise at such a call. Switch it
off with ``F8TENSOR_CHECK_CUDA_RULES=0 pytest ...``.

``device_param``: a CPU test marked with it also runs on ``cuda``. It is parametrized over
the ``device`` fixture: the ``cpu`` variant is the test as written; the ``cuda`` variant is
marked ``gpu`` (so skipped without an FP8 GPU, and selected by ``pytest -m gpu``) and runs
the same body with ``torch.set_default_device("cuda")``, so every tensor and module the
test creates without naming a device lives on the GPU. (Tensors a test creates on the CPU
explicitly, and the package's own device handling, are covered by the tests written for
CUDA: kernels/test_gpu_scaled_mm.py and the GPU campaign's checks.) ``pytest -m "device_param and gpu"
--collect-only -q`` lists the re-run set.

GPU tests that need a block-scaled or FP4 kernel skip where the kernel rules say this
device and build have none (``tests.helpers.kernel_skip_reason``, the one gate): a
``gpu`` test (``cuda`` variants included) for each recipe named in its parameters and for
the products its ``kernel`` marker names, e.g. ``@pytest.mark.kernel(blocks=((1, 128), (128,
128), torch.float32))`` or ``@pytest.mark.kernel("mxfp8")``.
"""

from __future__ import annotations

import os

import pytest
import torch

_RULES_ENV = "F8TENSOR_CHECK_CUDA_RULES"


def _rules_check_on() -> bool:
    return os.environ.get(_RULES_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def pytest_configure(config):
    # Under xdist (README's `-n auto`) the workers share the CPUs: torch's default threads in
    # each would oversubscribe them.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    if _rules_check_on():
        os.environ[_RULES_ENV] = "1"  # for subprocesses
        from f8tensor import gemm

        # In this process: record, and fail the test at teardown (a raise inside the op
        # could be swallowed by a test's own pytest.raises).
        gemm.install_rules_check(raise_on_violation=False)


@pytest.fixture(autouse=True)
def _cuda_rules_check():
    """Fail a test whose ``torch._scaled_mm`` calls a supported CUDA build would refuse."""
    from f8tensor import gemm

    check = gemm.rules_check_installed()
    if check is None:
        yield None
        return
    check.take()
    yield check
    found = check.take()
    if found:
        shown = "\n  ".join(dict.fromkeys(found))
        what = f"{len(found)} torch._scaled_mm call(s) a supported CUDA build would refuse"
        pytest.fail(f"{what}:\n  {shown}", pytrace=False)


@pytest.fixture
def cuda_rules(_cuda_rules_check):
    """The installed rules check (skips the test when the check is switched off). A test
    that makes illegal calls on purpose drains them with ``cuda_rules.take()``."""
    if _cuda_rules_check is None:
        pytest.skip(f"the CUDA rules check is off ({_RULES_ENV}=0)")
    return _cuda_rules_check


@pytest.fixture
def no_rules_check(_cuda_rules_check):
    """Count what a user's step runs: the rules check mode records the products' arguments
    (more ops, calls and guards); it is switched off for the test and back on after it."""
    from f8tensor import gemm

    if _cuda_rules_check is None:
        yield
        return
    raising = _cuda_rules_check.raise_on_violation
    gemm.uninstall_rules_check()
    try:
        yield
    finally:
        gemm.install_rules_check(raise_on_violation=raising)


def _fp8_gpu_reason() -> str | None:
    """None when a CUDA device with FP8 tensor cores (capability >= 8.9) is present."""
    if not torch.cuda.is_available():
        return "needs CUDA (no CUDA device available)"
    capability = torch.cuda.get_device_capability()
    if capability < (8, 9):
        return f"needs compute capability >= 8.9 for FP8 matmuls; device has {capability}"
    return None


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("device_param") is not None:
        devices = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
        metafunc.parametrize("device", devices, indirect=True)


@pytest.fixture
def device(request) -> str:
    """The device a ``device_param`` test runs on ("cpu" for every other test)."""
    return getattr(request, "param", "cpu")


@pytest.fixture(autouse=True)
def _default_device(device):
    """``cuda`` variants of ``device_param`` tests create their tensors on the GPU."""
    if device == "cpu":
        yield
        return
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


#: Tests that take 6 s or more on a 2-core CPU (``--durations``), run in CI's
#: slow part (``-m slow``) and left out of README's command, which they would double. A node
#: id, or a prefix of one (every parameter of that test).
SLOW_TESTS = (
    # Round 5's slower additions (6 s or more on this machine).
    "tests/export/test_fp8_stream.py::test_generator_holds_one_layers_new_tensors_at_a_time",
    "tests/distributed/test_fp8_stream_sharded.py",
    "tests/project/test_bench_memory_whole_step.py",
    "tests/moe/test_moe.py::test_compiled_group_cast_writes_no_padded_copy",  # an inductor build
    # The campaign's dry runs (two module fixtures, ~3.5 min together).
    "tests/project/test_gpu_campaign.py::test_dry_run_writes_at_most_8_files_with_plain_names",
    "tests/project/test_gpu_campaign.py::test_environment_is_printed_first",
    "tests/project/test_gpu_campaign.py::test_every_item_ran_or_says_why",
    "tests/project/test_gpu_campaign.py::test_default_plan_measures_every_item_and_judges_every_target",
    "tests/project/test_gpu_campaign.py::test_second_plan_profiles_missed_figures_and_reports_absent_hooks",
    "tests/project/test_gpu_campaign.py::test_smoke_holds_stochastic_recipes_to_the_cpus_accuracy",
    "tests/project/test_gpu_campaign.py::test_activation_casts_check_measures_bytes_kernels_and_time",
    "tests/project/test_tutorials.py::test_tutorial_runs[05_torch_compile.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[07_models_from_other_libraries.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[11_2d_parallel.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[06_fsdp2_float8.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[03_training_float8linear.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[04_delayed_vs_dynamic.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[14_export_for_inference.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[09_moe.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[12_fp4.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[13_optimizer_memory.py]",
    "tests/optim/test_optim.py::test_low_precision_states_close_to_fp32_states",
    "tests/reliability/test_model_switches.py::test_two_layer_mlp_compiles_with_dynamic_shapes[mxfp8]",
    "tests/reliability/test_edges_devices_checkpoints.py::test_compile_dynamic_true_forward_and_backward",
    "tests/distributed/test_tp.py::test_2d_fsdp2_x_tp_matches_one_process",
    "tests/distributed/test_fsdp.py::test_loss_parity_with_single_process",
    "tests/distributed/test_activations_fsdp.py::test_fsdp2_training_step_under_the_context",
    "tests/distributed/test_fsdp_block_shards.py::test_cut_and_uneven_shards_gather_one_process_cast",
    "tests/distributed/test_optim_fsdp.py::test_sharded_step_equals_one_process_bit_for_bit",
    "tests/project/test_benchmarks.py::test_bench_e2e",
    "tests/project/test_benchmarks.py::test_bench_cast_traffic",
    "tests/project/test_benchmarks.py::test_bench_comm",
    "tests/project/test_benchmarks.py::test_bench_linear_compiled",
    "tests/project/test_benchmarks.py::test_bench_memory",
    "tests/project/test_benchmarks.py::test_bench_routes",
    "tests/project/test_bench_e2e_graphs.py::test_tensorwise_table",
    "tests/recipes/test_block_recipes.py::test_stochastic_grad_output_compiles_with_dynamic_shapes",
    "tests/recipes/test_block_recipes.py::test_stochastic_grad_output_compiles_fullgraph[mxfp8]",
    "tests/recipes/test_fp4_compile.py::test_fp4_stochastic_gradients_compile_with_dynamic_shapes",
    "tests/project/test_demo.py::test_tiny_run_prints_a_row_per_run_and_writes_the_png",
    "tests/project/test_bit_identity.py::test_compiled_runs_bit_identical",
    "tests/clients/test_client_accelerate_fsdp2.py::test_fsdp2_optimizer_mapping_keeps_every_fp8_weight",
    "tests/nn/test_linear_compile.py::test_compile_varying_token_counts",
    "tests/nn/test_compile_per_block.py::test_blocks_compiled_one_by_one_share_one_graph",
    "tests/quant/test_delayed_scaling.py::test_compiled_checkpoint_resume_is_bit_exact",
    "tests/optim/test_optim_compiled_step.py::test_compiled_step_has_no_graph_break_and_one_graph",
    "tests/optim/test_optim_compiled_step.py::test_inductor_compiled_cpu_step_is_the_torch_ops_step",
    "tests/optim/test_optim_compiled_step.py::test_compiled_step_follows_lr_and_new_parameters_without_graph_breaks",
    "tests/nn/test_telemetry.py::test_keys_are_stable[delayed]",
    "tests/nn/test_compile_block_gradients.py::test_block_weight_grads_compiled_inductor",
    "tests/nn/test_compile_cuda_path.py",
    "tests/nn/test_compile_static_buffers.py::test_compiled_delayed_state_is_updated_in_place[reduce-overhead]",
    # 10 s or more in a fresh clone on the 2-core machine (`--durations`, cold compile caches).
    "tests/clients/test_client_hf_moe.py::test_hf_moe_block_compiles_once_for_changing_token_counts",
    "tests/distributed/test_tp.py::test_checkpoint_from_a_1d_mesh_loads_into_a_2d_mesh",  # the slow 2D fixture's
    "tests/project/test_readme.py::test_readme_block_runs[docs/modules.rst:88]",
    "tests/nn/test_linear_compile.py::test_compile_fullgraph_inductor[cpu-delayed]",
    "tests/nn/test_linear_compile.py::test_compile_fullgraph_inductor[cpu-tensorwise]",
    "tests/nn/test_linear_compile.py::test_inductor_multiplies_blocks_as_eager_does[mxfp8]",
    "tests/nn/test_linear_compile.py::test_inductor_multiplies_blocks_as_eager_does[blockwise]",
    "tests/moe/test_moe_layouts.py::test_compiled_step_equals_eager_and_makes_no_copy_or_scatter",
    "tests/nn/test_telemetry.py::test_inductor_stats_equal_eager",
    "tests/project/test_gpu_campaign.py::test_budget_20_ends_within_20_s_with_its_files",
    "tests/project/test_bench_optim.py::test_quality_trains_the_demo_per_optimizer_and_seed",
    # 6 s or more there.
    "tests/nn/test_memory_flat_over_steps.py::test_memory_is_flat_over_300_steps",
    "tests/project/test_tutorials.py::test_tutorial_runs[15_fp8_checkpoint_finetune.py]",
    "tests/project/test_tutorials.py::test_tutorial_runs[01_fp8_formats.py]",
    "tests/distributed/test_nan_collectives.py::test_all_reduce_max_keeps_nan_from_any_rank",
    "tests/project/test_gpu_campaign.py::test_a_spent_budget_marks_every_item_not_run",
    "tests/project/test_gpu_campaign.py::test_an_item_is_stopped_at_its_deadline_and_the_next_runs",
    "tests/gemm/test_gemm_routes.py::test_env_var_checks_products_and_import_changes_nothing",
    "tests/recipes/test_block_recipes.py::test_tiny_transformer_trains_within_2_percent_of_bf16[mxfp8]",
    "tests/nn/test_telemetry.py::test_stats_off_leaves_the_graph_unchanged[delayed]",
    "tests/nn/test_telemetry.py::test_stats_off_leaves_the_graph_unchanged[rowwise]",
    "tests/distributed/test_moe_fsdp.py::test_fsdp2_shards_fp8_expert_weights",
    "tests/nn/test_weight_cache_copies.py::test_a_weight_broadcast_from_another_rank_is_cast_again",
    "tests/project/test_benchmarks.py::test_bench_moe",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
    # Only tests marked `gpu` are skipped; the CPU tests always run.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _fp8_gpu_reason()
    if reason is None:
        from tests.helpers import gpu_test_skip_reason

        for item in gpu_items:
            why = gpu_test_skip_reason(item)
            if why is not None:
                item.add_marker(pytest.mark.skip(reason=why))
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    """Every test draws the same random numbers whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture
def fresh_dynamo():
    """Reset torch.compile's caches before and after a compile test (frame counts start at 0)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests on one thread, restored afterwards.

    For modules that train tiny models: their GEMMs are too small for threads to help,
    and on a shared machine extra threads make the runs several times slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide ``AcceleratorState``: an ``Accelerator`` made with
    other options than an earlier test's refuses to start. Reset it around the test."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    state.AcceleratorState._reset_state(reset_partial_state=True)
