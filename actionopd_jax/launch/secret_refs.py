"""Secrets by reference: `ENV=secret` flags naming a Secret Manager secret, never its value.

Launchers put only references (`projects/P/secrets/S/versions/V`) into the commands and job
specs they print or submit; the job's entrypoint (`actionopd_jax.launch.entrypoint`) reads
the value on the worker at start-up and hands it to the trainer through its environment.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import re
from typing import Mapping

from actionopd_jax.launch.common import ENV_NAME_RE, LaunchError

SECRET_MANAGER_ENDPOINT = "https://secretmanager.googleapis.com"
# Overrides the API endpoint (private service connect, or a loopback server in tests).
ENDPOINT_ENV = "ACTIONOPD_SECRET_MANAGER_ENDPOINT"

_SECRET_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,255}$")
_VERSION_RE = re.compile(r"^(latest|[0-9]+|[A-Za-z][A-Za-z0-9_-]{0,62})$")
# project ids (incl. domain-scoped "example.com:proj") or project numbers
_PROJECT_RE = re.compile(r"^[a-z0-9][a-z0-9.:-]{0,62}$")
_RESOURCE_RE = re.compile(r"^projects/([^/]+)/secrets/([^/]+)(?:/versions/([^/]+))?$")
# Prefixes of common API-key formats: such a string is a value, not a secret's name.
_VALUE_PREFIXES = ("sk-", "sk_", "AIza", "ghp_", "gho_", "github_pat_", "hf_", "xoxb-", "xoxp-",
                   "ya29.", "Bearer ")


@dataclasses.dataclass(frozen=True)
class SecretRef:
    """Environment variable `env_name` gets the payload of one Secret Manager secret version."""
    env_name: str
    project: str
    secret: str
    version: str = "latest"

    @property
    def resource(self) -> str:
        return f"projects/{self.project}/secrets/{self.secret}/versions/{self.version}"

    def flag(self) -> str:
        """The `ENV=resource` form the entrypoint takes."""
        return f"{self.env_name}={self.resource}"


def _refuse_value(env_name: str, ref: str, environ: Mapping[str, str]) -> None:
    hint = (f"--secret {env_name}=... takes the NAME of a Secret Manager secret (e.g. "
            f"--secret {env_name}=teacher-api-key or projects/P/secrets/S/versions/latest), "
            "not the secret value; store the value with `gcloud secrets create` and pass its name")
    current = environ.get(env_name)
    if current and ref == current:
        raise LaunchError(f"the reference for {env_name} equals ${env_name} in your environment: "
                          f"that is a secret value. {hint}")
    if ref.startswith(_VALUE_PREFIXES):
        raise LaunchError(f"the reference for {env_name} looks like an API key. {hint}")


def parse_secret_flag(item: str, *, default_project: str | None,
                      environ: Mapping[str, str] | None = None) -> SecretRef:
    """Parse `ENV=SECRET`, `ENV=SECRET:VERSION` or `ENV=projects/P/secrets/S[/versions/V]`.

    Short forms take the project from `default_project`. Raises LaunchError when the right-hand
    side is not a reference (in particular when it looks like a secret value).
    """
    environ = os.environ if environ is None else environ
    env_name, sep, ref = item.partition("=")
    if not sep or not ref:
        raise LaunchError(f"--secret {env_name or item!r}: expected ENV_NAME=SECRET_NAME")
    if not ENV_NAME_RE.match(env_name):
        raise LaunchError(f"--secret: {env_name!r} is not a valid environment variable name")
    _refuse_value(env_name, ref, environ)
    if ref.startswith("projects/"):
        match = _RESOURCE_RE.match(ref)
        if not match:
            raise LaunchError(f"--secret {env_name}: {ref!r} is not projects/P/secrets/S[/versions/V]")
        project, secret, version = match.group(1), match.group(2), match.group(3) or "latest"
    else:
        secret, _, version = ref.partition(":")
        version = version or "latest"
        if default_project is None:
            raise LaunchError(f"--secret {env_name}={ref}: a short secret name needs a project; "
                              "pass the full projects/P/secrets/S/versions/V path")
        project = default_project
    if not _PROJECT_RE.match(project):
        raise LaunchError(f"--secret {env_name}: {project!r} is not a Google Cloud project id or number")
    if not _SECRET_ID_RE.match(secret):
        raise LaunchError(f"--secret {env_name}: {secret!r} is not a Secret Manager secret name "
                          "(letters, digits, - and _ only). Pass the secret's NAME, not its value")
    if not _VERSION_RE.match(version):
        raise LaunchError(f"--secret {env_name}: version {version!r} must be 'latest', a number or an alias")
    return SecretRef(env_name=env_name, project=project, secret=secret, version=version)


def parse_secret_flags(items: list[str], *, default_project: str | None,
                       environ: Mapping[str, str] | None = None) -> list[SecretRef]:
    refs = [parse_secret_flag(i, default_project=default_project, environ=environ) for i in items]
    names = [r.env_name for r in refs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise LaunchError(f"--secret given twice for {', '.join(duplicates)}")
    return refs


def access_secret(ref: SecretRef, *, session=None, endpoint: str | None = None,
                  timeout_s: float = 30.0) -> str:
    """Read one secret version through the Secret Manager REST API (`versions/*:access`).

    `session` is an authorized `requests`-style session; by default one is built from
    Application Default Credentials (on a TPU VM / Vertex worker: its service account, which
    needs roles/secretmanager.secretAccessor). The value is returned, never logged.
    """
    if session is None:
        import google.auth
        from google.auth.transport.requests import AuthorizedSession

        credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        session = AuthorizedSession(credentials)
    base = (endpoint or os.environ.get(ENDPOINT_ENV) or SECRET_MANAGER_ENDPOINT).rstrip("/")
    response = session.get(f"{base}/v1/{ref.resource}:access", timeout=timeout_s)
    if response.status_code != 200:
        # the error body comes from the API and holds no payload; keep it short
        raise RuntimeError(f"Secret Manager refused {ref.resource} for {ref.env_name}: "
                           f"HTTP {response.status_code} {response.text[:300]}")
    data = response.json().get("payload", {}).get("data")
    if data is None:
        raise RuntimeError(f"Secret Manager answer for {ref.resource} has no payload.data")
    return base64.b64decode(data).decode("utf-8")
