"""Launchers: TPU pods (gcloud ssh --worker=all), Vertex AI custom jobs, local GPU hosts.

The documented entry points are the scripts of the repository's top-level `launch/` folder
(the design card's `launch/`):

    python launch/tpu_pod.py   --help
    python launch/vertex.py    --help
    python launch/local_gpu.py --help
    docker build -f launch/Dockerfile ...   (the Vertex AI image)

They are thin wrappers around `main()` of `tpu_pod`, `vertex` and `local_gpu` here. The logic
lives in the package so that it is importable by tests and installed with the package: the
job-side `entrypoint` (python -m actionopd_jax.launch.entrypoint) must exist in the container
or on the TPU VM, where only the installed package is guaranteed. Every launcher runs the
same training command on the workers (`actionopd train --config C [overrides]`, common.py).
"""
