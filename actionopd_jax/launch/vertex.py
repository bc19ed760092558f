"""Vertex AI custom-job launcher: the training command on a TPU slice or on GPU nodes.

    python launch/vertex.py --project my-proj --region us-central1 \
        --image us-docker.pkg.dev/my-proj/actionopd/actionopd-jax:tpu \
        --machine-type ct5lp-hightpu-4t --tpu-topology 4x4 \
        --staging-bucket gs://my-bucket --secret OPENAI_API_KEY=teacher-api-key \
        --config configs/paper/qwen3_8b_tpu.yaml train.steps=200 [--dry-run]

The job is an `aiplatform_v1.CustomJob` proto built offline; `--dry-run` prints the exact
CreateCustomJob request (parent + job) as JSON and the real run sends that same proto with
`aiplatform_v1.JobServiceClient.create_custom_job`. Custom-job containers have no field for
Secret Manager environment variables, so secrets are passed by NAME as arguments of
`actionopd_jax.launch.entrypoint`, which reads them on the worker with the job's service
account (grant it roles/secretmanager.secretAccessor).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import re
import sys
from pathlib import Path

from google.cloud.aiplatform_v1.types import CustomJob, CustomJobSpec, GcsDestination, Scheduling

from actionopd_jax.launch import vertex_pools
from actionopd_jax.launch.common import (GPU_ENV_DEFAULTS, LaunchError, check_config_for_machine, find_repo_root,
                                         merge_xla_flags, parse_env_assignments, resolve_config, train_command)
from actionopd_jax.launch.secret_refs import SecretRef, parse_secret_flags

_REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_PROJECT_RE = re.compile(r"^[a-z0-9][a-z0-9.:-]{0,62}$")
_LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[a-z]+$")
DEFAULT_WORKDIR = "/workspace/actionopd_jax"


@dataclasses.dataclass(frozen=True)
class VertexLaunch:
    project: str
    region: str
    display_name: str
    image_uri: str
    machine_type: str
    base_output_dir: str
    config: str                          # repo-relative; the image holds the checkout at workdir
    tpu_topology: str | None = None
    replicas: int = 1                    # GPU nodes (TPU: always 1, the slice)
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    secrets: tuple[SecretRef, ...] = ()
    workdir: str = DEFAULT_WORKDIR
    service_account: str | None = None
    network: str | None = None
    timeout_hours: float | None = None
    spot: bool = False
    boot_disk_gb: int | None = None
    labels: tuple[tuple[str, str], ...] = ()
    coordinator_port: int | None = None

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.region}"

    @property
    def api_endpoint(self) -> str:
        return f"{self.region}-aiplatform.googleapis.com"


def container_command(launch: VertexLaunch) -> list[str]:
    """What every replica runs: the training command, behind the entrypoint when it needs one."""
    train = train_command(f"{launch.workdir.rstrip('/')}/{launch.config}", list(launch.overrides))
    multi_node_gpu = not vertex_pools.is_tpu(launch.machine_type) and launch.replicas > 1
    if not launch.secrets and not multi_node_gpu:
        return train
    command = ["python", "-m", "actionopd_jax.launch.entrypoint"]
    for ref in launch.secrets:
        command += ["--secret", ref.flag()]
    if multi_node_gpu:
        # GPU replicas learn their process id from Vertex's CLUSTER_SPEC (TPU: JAX finds it)
        command.append("--vertex-cluster-spec")
        if launch.coordinator_port is not None:
            command += ["--coordinator-port", str(launch.coordinator_port)]
    return [*command, "--", *train]


def container_env(launch: VertexLaunch) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    if not vertex_pools.is_tpu(launch.machine_type):
        env.update(GPU_ENV_DEFAULTS)
    return merge_xla_flags(env, dict(launch.env))


def build_custom_job(launch: VertexLaunch) -> CustomJob:
    """The CustomJob proto (pure: no credentials, project lookup or network)."""
    spec = CustomJobSpec(
        worker_pool_specs=vertex_pools.worker_pools(
            machine_type=launch.machine_type, tpu_topology=launch.tpu_topology, replicas=launch.replicas,
            image_uri=launch.image_uri, command=container_command(launch), env=container_env(launch),
            boot_disk_gb=launch.boot_disk_gb),
        base_output_directory=GcsDestination(output_uri_prefix=launch.base_output_dir))
    if launch.service_account:
        spec.service_account = launch.service_account
    if launch.network:
        spec.network = launch.network
    if launch.timeout_hours or launch.spot:
        scheduling = Scheduling()
        if launch.timeout_hours:
            scheduling.timeout = datetime.timedelta(hours=launch.timeout_hours)
        if launch.spot:
            scheduling.strategy = Scheduling.Strategy.SPOT
        spec.scheduling = scheduling
    return CustomJob(display_name=launch.display_name, job_spec=spec, labels=dict(launch.labels))


def request_json(launch: VertexLaunch, job: CustomJob) -> str:
    """The exact CreateCustomJob request as JSON (what --dry-run prints)."""
    return json.dumps({"api_endpoint": launch.api_endpoint, "parent": launch.parent,
                       "custom_job": json.loads(CustomJob.to_json(
                           job, use_integers_for_enums=False,
                           always_print_fields_with_no_presence=False))}, indent=2)


def submit(launch: VertexLaunch, job: CustomJob) -> str:
    """Create the job (network; uses Application Default Credentials). Returns its resource name."""
    from google.cloud import aiplatform_v1

    client = aiplatform_v1.JobServiceClient(client_options={"api_endpoint": launch.api_endpoint})
    created = client.create_custom_job(parent=launch.parent, custom_job=job)
    return created.name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python launch/vertex.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--project", help="Google Cloud project id")
    p.add_argument("--region", help="Vertex AI region, e.g. us-central1")
    p.add_argument("--image", help="container image with the checkout installed at --workdir (see launch/Dockerfile)")
    p.add_argument("--machine-type", help=f"TPU: {', '.join(vertex_pools.TPU_MACHINES)}; "
                                          f"GPU: {', '.join(vertex_pools.GPU_MACHINES)}")
    p.add_argument("--tpu-topology", help="TPU slice shape, e.g. 4x4 (TPU machine types only)")
    p.add_argument("--replicas", type=int, default=1, help="GPU nodes (one process each)")
    p.add_argument("--config", help="training config inside the checkout, e.g. configs/paper/qwen3_4b_h200x8.yaml")
    p.add_argument("overrides", nargs="*", help="config overrides section.key=value")
    p.add_argument("--staging-bucket", help="gs:// bucket; outputs go under BUCKET/actionopd/DISPLAY_NAME")
    p.add_argument("--base-output-dir", help="gs:// directory for job outputs (sets AIP_MODEL_DIR etc.)")
    p.add_argument("--display-name", help="job name (default: actionopd-<config name>)")
    p.add_argument("--service-account", help="service account email the job runs as")
    p.add_argument("--network", help="VPC network, projects/NUMBER/global/networks/NAME")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="plain environment variable (not for credentials)")
    p.add_argument("--secret", action="append", default=[], metavar="ENV=SECRET",
                   help="fill ENV on each replica from Secret Manager secret SECRET (by name)")
    p.add_argument("--workdir", default=DEFAULT_WORKDIR, help="checkout location inside the image")
    p.add_argument("--timeout-hours", type=float, help="job timeout")
    p.add_argument("--spot", action="store_true", help="use Spot capacity")
    p.add_argument("--boot-disk-gb", type=int, help="boot disk size per replica")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="job label")
    p.add_argument("--coordinator-port", type=int, help="JAX coordinator port on GPU replica 0")
    p.add_argument("--repo-root", help="the local checkout (default: found from the current directory)")
    p.add_argument("--dry-run", action="store_true", help="print the job request JSON, submit nothing")
    return p


def _gcs(flag: str, value: str) -> str:
    if not value.startswith("gs://") or len(value) <= len("gs://"):
        raise LaunchError(f"{flag} {value!r} must be a gs:// location, e.g. gs://my-bucket")
    return value.rstrip("/")


def _check_config_for(path: Path, args: argparse.Namespace) -> None:
    """The config must run on the machines asked for (its mesh.target and batch layout)."""
    if vertex_pools.is_tpu(args.machine_type):
        tpu = vertex_pools.TPU_MACHINES[args.machine_type]
        chips = math.prod(int(d) for d in args.tpu_topology.split("x"))
        check_config_for_machine(path, list(args.overrides), machine=f"{args.machine_type} {args.tpu_topology}",
                                 platform="tpu", chips=chips, generation=tpu.generation,
                                 hosts=vertex_pools.tpu_hosts(args.machine_type, args.tpu_topology))
    else:
        gpus = vertex_pools.GPU_MACHINES[args.machine_type].gpus * args.replicas
        check_config_for_machine(path, list(args.overrides), machine=f"{args.replicas} x {args.machine_type}",
                                 platform="gpu", chips=gpus, hosts=args.replicas)


def launch_from_args(args: argparse.Namespace) -> VertexLaunch:
    """Validate parsed flags into a VertexLaunch (LaunchError with a clear message otherwise)."""
    missing = [f"{flag} ({example})" for flag, value, example in (
        ("--project", args.project, "my-gcp-project"), ("--region", args.region, "us-central1"),
        ("--image", args.image, "us-docker.pkg.dev/PROJECT/REPO/actionopd-jax:tpu"),
        ("--machine-type", args.machine_type, "ct5lp-hightpu-4t or a3-ultragpu-8g")) if not value]
    if missing:
        raise LaunchError(f"missing {', '.join(missing)}")
    if not _PROJECT_RE.match(args.project):
        raise LaunchError(f"--project {args.project!r} is not a Google Cloud project id")
    if not _REGION_RE.match(args.region):
        raise LaunchError(f"--region {args.region!r} is not a region like us-central1 (not a zone)")
    if any(c.isspace() for c in args.image):
        raise LaunchError(f"--image {args.image!r} contains whitespace")
    vertex_pools.check_machine(args.machine_type, tpu_topology=args.tpu_topology, replicas=args.replicas)
    if not args.staging_bucket and not args.base_output_dir:
        raise LaunchError("missing --staging-bucket (gs://BUCKET) or --base-output-dir (gs://BUCKET/DIR): "
                          "the job needs a Cloud Storage location for its outputs")
    repo_root = Path(args.repo_root).resolve() if args.repo_root else find_repo_root()
    config = resolve_config(args.config, repo_root)
    _check_config_for(repo_root / config, args)
    display_name = args.display_name or f"actionopd-{Path(config).stem.replace('_', '-')}"
    base_output_dir = (_gcs("--base-output-dir", args.base_output_dir) if args.base_output_dir else
                       f"{_gcs('--staging-bucket', args.staging_bucket)}/actionopd/{display_name}")
    if not args.workdir.startswith("/"):
        raise LaunchError(f"--workdir {args.workdir!r} must be an absolute path inside the image")
    if args.service_account and not _EMAIL_RE.match(args.service_account):
        raise LaunchError(f"--service-account {args.service_account!r} is not a service account email")
    if args.timeout_hours is not None and args.timeout_hours <= 0:
        raise LaunchError("--timeout-hours must be > 0")
    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not _LABEL_RE.match(key) or not _LABEL_VALUE_RE.match(value):
            raise LaunchError(f"--label {item!r}: expected key=value, lowercase letters, digits, - and _")
        labels[key] = value
    return VertexLaunch(
        project=args.project, region=args.region, display_name=display_name, image_uri=args.image,
        machine_type=args.machine_type, tpu_topology=args.tpu_topology, replicas=args.replicas,
        base_output_dir=base_output_dir, config=config, overrides=tuple(args.overrides),
        env=tuple(parse_env_assignments(args.env).items()),
        secrets=tuple(parse_secret_flags(args.secret, default_project=args.project)),
        workdir=args.workdir, service_account=args.service_account, network=args.network,
        timeout_hours=args.timeout_hours, spot=args.spot, boot_disk_gb=args.boot_disk_gb,
        labels=tuple(labels.items()), coordinator_port=args.coordinator_port)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launch = launch_from_args(args)
        job = build_custom_job(launch)
    except LaunchError as err:
        print(f"vertex: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(request_json(launch, job))
        return 0
    if launch.secrets and not launch.service_account:
        print("vertex: note: secrets are read with the job's service account; without "
              "--service-account Vertex uses its default agent, which needs secretAccessor", file=sys.stderr)
    name = submit(launch, job)
    print(f"submitted {name}\nhttps://console.cloud.google.com/vertex-ai/locations/{launch.region}/"
          f"training/{name.rsplit('/', 1)[-1]}?project={launch.project}")
    return 0
