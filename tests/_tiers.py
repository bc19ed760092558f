"""The suite's two tiers. README's test command (what CI runs) deselects the extended tier with
`-m "not extended"`, so that a clean clone's install plus tests fit CI's 20 minutes on 2 cores.
The full suite, both tiers, is the same command without `-m`; BUILD_NOTES ("Test") says when
it must run: before every stop, and before a call on a lent accelerator.

The extended tier is this list, nothing else (conftest.py marks its tests; no decorator is
needed, and a decorator alone would not be enough: tests/test_suite_budget.py checks that every
`extended` test is listed here). A test belongs here only when it is a long composition of parts
that CI-tier tests already exercise one by one: an end-to-end run through the CLI, a second
kill-and-resume, a second variant of a cross-target compile. Each entry names why, and the
CI-tier tests that still cover its parts; a cover may not be extended itself.

Test ids are pytest node ids; an id without `[...]` takes every parametrization.
"""

from __future__ import annotations

# node id -> (why it is extended, CI-tier tests that cover its parts)
EXTENDED: dict[str, tuple[str, tuple[str, ...]]] = {
    "tests/test_experiment_main_job.py::test_short_main_job_through_the_cli": (
        "the whole README main job in a subprocess (~90 s): KD warm start, an ActionOPD step, two evaluations",
        ("tests/test_experiment.py::test_report_shows_curves_and_before_after",
         "tests/test_experiment.py::test_reference_teacher_is_labelled_and_serves_training_tasks_only",
         "tests/test_baselines_kd.py::test_kd_trains_through_the_trainer_only_target_tokens_carry_loss",
         "tests/test_smoke_run.py::test_smoke_run_is_evaluated_served_and_exported_and_a_rerun_trains_nothing")),
    "tests/test_baselines_self.py::test_self_actionopd_teacher_is_the_current_student_with_privileged_context": (
        "fits a warm student for 50 steps, then two Self-ActionOPD steps (~80 s)",
        ("tests/test_baselines_self.py::test_config_builds_the_self_source_and_rejects_self_teacher_outside_actionopd",
         "tests/test_baselines_self.py::test_privileged_context_comes_from_the_task_and_never_from_the_public_conversation")),
    "tests/test_compare.py::test_compare_one_update_budget_failing_method_and_table": (
        "five methods end to end, each a run with its warm start and evaluation (~65 s)",
        ("tests/test_compare.py::test_update_budget_keeps_at_most_the_rows_of_the_remaining_updates",
         "tests/test_compare.py::test_the_report_gives_each_methods_wall_clock_and_its_ratio_to_actionopd",
         "tests/test_compare.py::test_the_step_cap_and_a_failed_step_stop_the_asynchronous_loop")),
    "tests/test_collect_async_kill.py::test_kill9_under_eta_1_resumes_with_the_in_flight_draws_answered_from_the_cache": (
        "kill -9 of an asynchronous run and its resumption, three runs in subprocesses (~60 s)",
        ("tests/test_collect_async.py::test_eta_1_trains_within_the_bound_resumes_in_flight_draws_from_the_cache_and_stops_on_budget",
         "tests/test_checkpoint_kill.py::test_kill9_during_a_save_then_resume_matches_uninterrupted")),
    "tests/test_checkpoint_kill.py::test_kill9_between_saves_then_resume_matches_uninterrupted": (
        "the second kill -9 point of the same resume path",
        ("tests/test_checkpoint_kill.py::test_kill9_during_a_save_then_resume_matches_uninterrupted",)),
    "tests/test_device_check.py::test_dry_run_on_the_device_image_writes_the_documented_report": (
        "the whole device check at tiny shapes in the device image's package set (~100 s); run before a device call",
        ("tests/test_device_check.py::test_the_dry_run_plan_has_every_measurement_in_the_order_of_value",
         "tests/test_device_check.py::test_a_measurement_over_its_time_limit_is_killed_and_reported",
         "tests/test_device_check.py::test_a_program_loaded_from_the_cache_counts_as_a_compile_in_a_timed_call")),
    "tests/test_device_check.py::test_a_rerun_loads_what_the_first_call_compiled_from_the_shared_cache": (
        "a dry run twice in subprocesses; with the dry runs, before a device call",
        ("tests/test_device_check.py::test_a_program_loaded_from_the_cache_counts_as_a_compile_in_a_timed_call",)),
    "tests/test_remat_choice.py::test_check_aot_compiles_the_policy_auto_chose": (
        "a second TPU compile of a train step (~50 s)",
        ("tests/test_aot_tpu.py::test_tiny_train_step_compiles_for_v5p_with_splash_attention",
         "tests/test_remat_choice.py::test_the_run_uses_the_policy_check_printed")),
    "tests/test_aot_tpu.py::test_shared_prompt_rows_compile_for_v5p": (
        "a second TPU compile of a train step, with shared-prompt rows",
        ("tests/test_aot_tpu.py::test_tiny_train_step_compiles_for_v5p_with_splash_attention",
         "tests/test_train_shared_prompt.py::test_shared_prompt_step_equals_the_separate_rows")),
    "tests/test_sampler_tpu_aot.py::test_prefill_and_decode_compile_for_v5p": (
        "the sampler's TPU compile (~27 s) beside the train step's",
        ("tests/test_aot_tpu.py::test_tiny_train_step_compiles_for_v5p_with_splash_attention",
         "tests/test_paged_kernels.py::test_kernel_equals_gather_at_decode")),
    "tests/test_gpu_deviceless.py::test_gpu_decode_reads_each_layers_weights_in_place[engine]": (
        "the engine's variant of a CUDA compile whose static variant stays in CI",
        ("tests/test_gpu_deviceless.py::test_gpu_decode_reads_each_layers_weights_in_place",
         "tests/test_gpu_deviceless.py::test_the_engines_programs_compile_for_an_h100_and_copy_on_write_copies_pages_not_the_pool")),
    "tests/test_baselines_ablations.py::test_each_ablation_collects_its_rewards_and_commits_and_trains": (
        "every ablation through a collection and a train step (~50 s)",
        ("tests/test_baselines_ablations.py::test_ablation_switches_are_config_keys_with_clear_errors",
         "tests/test_collect_source.py::test_one_trainer_step_over_the_collector")),
    "tests/test_baselines_opd.py::test_opd_collects_student_trajectories_and_trains_on_sampled_token_reverse_kl": (
        "token-level OPD end to end (~45 s)",
        ("tests/test_baselines_opd.py::test_local_and_endpoint_scorers_give_the_teachers_logprobs_at_the_students_tokens",
         "tests/test_baselines_opd.py::test_echo_scoring_endpoint_matches_log_softmax_of_a_full_forward")),
    "tests/test_train_cli.py::test_smoke_then_run_then_resume": (
        "three `train` subprocesses (~40 s)",
        ("tests/test_smoke_run.py::test_smoke_run_is_evaluated_served_and_exported_and_a_rerun_trains_nothing",
         "tests/test_checkpoint.py::test_resume_on_another_mesh_continues_the_same_run")),
    "tests/test_train_shared_prompt.py::test_trainer_step_with_shared_prompt_equals_the_plain_one": (
        "the trainer-level twin of a step-level equality (~37 s)",
        ("tests/test_train_shared_prompt.py::test_shared_prompt_step_equals_the_separate_rows",)),
    "tests/test_collect_envscaler.py::test_tiny_train_on_the_mixture_then_eval_on_held_out_tasks": (
        "`actionopd train` on the EnvScaler mixture, then `eval --checkpoint` (~35 s)",
        ("tests/test_collect_envscaler.py::test_tiny_model_collection_step_over_the_mixture",
         "tests/test_collect_envscaler.py::test_eval_on_held_out_envscaler_tasks_prints_success")),
    "tests/test_orbax_eval.py::test_readmes_evaluate_command_scores_every_episode_of_a_4096_position_student": (
        "README's evaluate command at 4,096 positions (~33 s)",
        ("tests/test_orbax_eval.py::test_eval_checkpoint_on_one_device_matches_its_hf_export",)),
    "tests/test_collect_distributed.py::test_two_processes_collect_disjoint_shares_equal_to_one_process": (
        "a third two-process jax.distributed run (~32 s)",
        ("tests/test_multihost.py::test_two_process_training_checkpoint_and_resume",
         "tests/test_multihost.py::test_a_lagging_process_makes_the_same_resume_choice")),
    "tests/test_collect_gather_multihost.py::test_two_processes_gather_the_sharded_policy_and_sample_locally": (
        "a fourth two-process jax.distributed run (~28 s)",
        ("tests/test_multihost.py::test_two_process_training_checkpoint_and_resume",
         "tests/test_sampler_sharded.py::test_sharded_params_give_the_same_samples")),
    "tests/test_aot_tpu.py::test_gpu_targets_compile_here_and_an_unknown_target_says_why": (
        "the AOT entry point's CUDA compiles (~25 s), beside the deviceless GPU tests",
        ("tests/test_gpu_deviceless.py::test_without_the_plugin_registered_the_target_says_why",
         "tests/test_gpu_deviceless.py::test_the_kinds_descriptions_and_a_compile_for_eight_h100s")),
    "tests/test_rollout_split.py::test_a_split_keeps_trainer_and_sampler_apart_and_trains_the_same": (
        "a split run's train steps beside a plain run's (~34 s)",
        ("tests/test_rollout_split.py::test_the_engine_samples_the_same_tokens_on_its_own_devices",
         "tests/test_rollout_split.py::test_the_reshard_is_one_program_and_never_goes_through_host_memory")),
    "tests/test_launch_harness.py::test_the_harness_stops_its_server_and_the_server_holds_toolsandboxs_30_messages[2]": (
        "SIGINT takes SIGTERM's path; SIGTERM and SIGKILL stay in CI",
        ("tests/test_launch_harness.py::test_the_harness_stops_its_server_and_the_server_holds_toolsandboxs_30_messages",)),
}


def extended_id(nodeid: str) -> str | None:
    """The EXTENDED key that takes this test, if any."""
    if nodeid in EXTENDED:
        return nodeid
    base = nodeid.split("[", 1)[0]
    return base if base in EXTENDED else None
