"""A Hugging Face hub on the loopback, for the real `huggingface_hub` client (HF_ENDPOINT).

It answers what the client's download path asks (huggingface_hub 1.x, file_download.py and
hf_api.py): the revision info of a repository (`/api/{models,datasets}/<id>/revision/<rev>`, with
`?blobs=true` the siblings' sizes, git blob ids and LFS sha256), and file resolution
(`HEAD`/`GET /<id>/resolve/<rev>/<file>`, `/datasets/<id>/resolve/...`) and the access check
(`/api/{models,datasets}/<id>/auth-check`), with the headers the client reads: X-Repo-Commit, ETag (the blob id, or the LFS sha256 as X-Linked-Etag) and the size. Errors
carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo), so the
client raises its own exception types.

Each repository holds commits (a dict of files), and branches that point at them; `push` adds a
commit and moves a branch, as a maintainer's push moves `main` on the real hub.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".parquet", ".bin")
"""Files the hub keeps in LFS (its default .gitattributes stores these as LFS pointers)."""


def blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class Repo:
    def __init__(self, gated: bool = False) -> None:
        self.commits: dict[str, dict[str, bytes]] = {}
        self.branches: dict[str, str] = {}
        self.gated = gated

    def push(self, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit holding `files` (the whole tree), and `branch` moved to it."""
        parent = self.branches.get(branch, "")
        body = parent + "".join(f"{k}:{blob_id(v)}" for k, v in sorted(files.items()))
        commit = hashlib.sha1(body.encode()).hexdigest()
        self.commits[commit] = dict(files)
        self.branches[branch] = commit
        return commit

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


class Hub:
    """The repositories, by (type, id), and the server that serves them."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[str] = []
        self.server: ThreadingHTTPServer | None = None

    def repo(self, repo_type: str, repo_id: str, gated: bool = False) -> Repo:
        return self.repos.setdefault((repo_type, repo_id), Repo(gated))

    @staticmethod
    def folder_files(folder: Path) -> dict[str, bytes]:
        folder = Path(folder)
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
                if p.is_file()}

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> Hub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub._answer(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- the routes ----------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        url = urlparse(h.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        self.requests.append(f"{h.command} {url.path}")
        if parts[:1] == ["api"] and len(parts) >= 6 and parts[4] == "revision":
            repo_type = {"models": "model", "datasets": "dataset"}.get(parts[1])
            return self._info(h, repo_type, "/".join(parts[2:4]), "/".join(parts[5:]), body)
        if parts[:1] == ["api"] and len(parts) == 5 and parts[4] == "auth-check":
            repo_type = {"models": "model", "datasets": "dataset"}.get(parts[1])
            repo, _ = self._lookup(h, repo_type, "/".join(parts[2:4]), None, body, files=True)
            if repo is not None:
                self._send(h, 200, b"{}", {"Content-Type": "application/json"}, body)
            return None
        repo_type = "model"
        if parts[:1] == ["datasets"]:
            repo_type, parts = "dataset", parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, repo_type, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        self._error(h, 404, "EntryNotFound", "no such route", body)

    def _lookup(self, h, repo_type, repo_id, revision, body, files: bool = False):
        """(the repository, the commit `revision` names); a gated one refuses its files (and the
        auth check) without a token, as the hub does, but shows anyone its record."""
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            self._error(h, 404, "RepoNotFound", f"Repository Not Found for url: {h.path}", body)
            return None, None
        if files and repo.gated and not h.headers.get("authorization"):
            self._error(h, 401, "GatedRepo", f"Access to {repo_id} is restricted", body)
            return None, None
        if revision is None:
            return repo, None
        commit = repo.resolve(revision)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            return None, None
        return repo, commit

    def _info(self, h, repo_type, repo_id, revision, body) -> None:
        repo, commit = self._lookup(h, repo_type, repo_id, revision, body)
        if repo is None:
            return
        siblings = []
        for name, data in sorted(repo.commits[commit].items()):
            sib = {"rfilename": name, "size": len(data), "blobId": blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                sib["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                              "pointerSize": 134}
            siblings.append(sib)
        info = {"id": repo_id, "_id": commit[:24], "sha": commit, "private": False,
                "gated": "auto" if repo.gated else False, "disabled": False, "downloads": 0,
                "likes": 0, "tags": [], "siblings": siblings,
                "lastModified": "2026-12-06T00:00:00.000Z", "createdAt": "2026-12-06T00:00:00.000Z"}
        self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)

    def _file(self, h, repo_type, repo_id, revision, name, body) -> None:
        repo, commit = self._lookup(h, repo_type, repo_id, revision, body, files=True)
        if repo is None:
            return
        data = repo.commits[commit].get(name)
        if data is None:
            self._error(h, 404, "EntryNotFound", f"{name} does not exist at {revision}", body)
            return
        headers = {"X-Repo-Commit": commit, "Content-Type": "application/octet-stream"}
        if name.endswith(LFS_SUFFIXES):
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["ETag"] = f'"{hashlib.sha256(data).hexdigest()}"'
        else:
            headers["ETag"] = f'"{blob_id(data)}"'
        self._send(h, 200, data, headers, body)

    def _error(self, h, status, code, message, body) -> None:
        payload = json.dumps({"error": message}).encode()
        self._send(h, status, payload, {"X-Error-Code": code, "X-Error-Message": message,
                                        "Content-Type": "application/json"}, body)

    @staticmethod
    def _send(h, status, data: bytes, headers: dict, body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)
