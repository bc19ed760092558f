"""The main job: the complete tiny experiment that `actionopd train` runs by default.

    KD warm start on BFCL training tasks -> ActionOPD steps -> before/after evaluation on
    held-out tasks -> run directory with TensorBoard logs, checkpoint and report.

With the embedded defaults the teacher is an embedded *privileged reference teacher* (our
OpenAI-compatible server answering with the environment's reference policy); a config switch
(teacher.kind=openai + base URL/model/API-key variable, model.hf_path) points the same job at
a real remote teacher and a real student checkpoint. See job.py for the phases.

Submodules are imported lazily (the `experiment:` section itself is `actionopd_jax.config.experiment`).
"""
