"""Launchers: TPU pods (gcloud ssh --worker=all), Vertex AI custom jobs, local GPU hosts.

The scripts in the repository's `launch/` folder are thin wrappers around `main()` of
`tpu_pod`, `vertex` and `local_gpu` here; the logic lives in the package so that it is
importable by tests and installed with the package (the job-side `entrypoint` must exist in
the container / on the TPU VM, where only the installed package is guaranteed).
"""
