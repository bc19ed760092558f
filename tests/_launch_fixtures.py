"""Builders shared by the launcher tests: a throwaway checkout, a no-network guard, and a
loopback stand-in for the Google OAuth token endpoint + Secret Manager REST API."""

from __future__ import annotations

import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ACCESS_TOKEN = "loopback-access-token"


def make_checkout(root: Path, configs: dict[str, str] | None = None) -> Path:
    """A directory that looks like the actionopd_jax checkout (pyproject, package dir, configs)."""
    (root / "actionopd_jax").mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'actionopd_jax'\n")
    (root / "configs").mkdir(exist_ok=True)
    # microbatches of 48 rows: the vertex launcher checks the layout splits over the 16 or 24 chips
    # (v5e 4x4, 2 or 3 x a3-ultragpu-8g) and the processes of the test machines
    tiny = "model:\n  preset: tiny\ntrain:\n  steps: 2\n  minibatch_rows: 48\n  microbatch_rows: 48\n"
    for name, text in (configs or {"tiny.yaml": tiny}).items():
        (root / "configs" / name).write_text(text)
    return root


class NetworkUsed(AssertionError):
    pass


def forbid_network(monkeypatch) -> list[str]:
    """Make every outgoing connection or DNS lookup fail loudly; returns the list of attempts."""
    attempts: list[str] = []

    def refuse(*args, **kwargs):
        attempts.append(repr(args[1:] if args and isinstance(args[0], socket.socket) else args))
        raise NetworkUsed(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def clear_google_credentials(monkeypatch, tmp_path: Path) -> None:
    """No ADC file, no gcloud config, no metadata server: any credential lookup would fail."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud-config"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")


class SecretManagerStub:
    """Loopback HTTP server answering `POST /token` (OAuth refresh) and
    `GET /v1/projects/P/secrets/S/versions/V:access` for the secrets it holds.

    Access requires the bearer token handed out by /token, so a client must really go
    through the google-auth refresh flow first.
    """

    def __init__(self, secrets: dict[str, str]):
        self.secrets = secrets
        self.requests: list[tuple[str, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                stub.requests.append(("POST", self.path))
                if self.path == "/token":
                    self._send(200, {"access_token": ACCESS_TOKEN, "expires_in": 3600, "token_type": "Bearer"})
                else:
                    self._send(404, {"error": "not found"})

            def do_GET(self):
                stub.requests.append(("GET", self.path))
                if self.headers.get("Authorization") != f"Bearer {ACCESS_TOKEN}":
                    self._send(401, {"error": {"code": 401, "message": "missing or bad token"}})
                    return
                resource = self.path.removeprefix("/v1/").removesuffix(":access")
                if resource not in stub.secrets:
                    self._send(404, {"error": {"code": 404, "message": f"Secret [{resource}] not found"}})
                    return
                data = base64.b64encode(stub.secrets[resource].encode()).decode()
                self._send(200, {"name": resource, "payload": {"data": data}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def write_adc_file(self, path: Path) -> Path:
        """A service-account key file (fresh RSA key) whose token endpoint is this server.

        google-auth signs a JWT with the key and exchanges it at `token_uri`, exactly as it
        would against oauth2.googleapis.com.
        """
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
        path.write_text(json.dumps({
            "type": "service_account", "project_id": "my-proj", "private_key_id": "test-key-id",
            "private_key": pem, "client_email": "trainer@my-proj.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": f"{self.url}/token"}))
        return path
