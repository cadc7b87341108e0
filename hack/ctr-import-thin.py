#!/usr/bin/env python3
"""Import a docker-archive into a node's containerd, sending only the layers it lacks.

`ctr images import` of a docker-archive reads every layer of the tar again, and the trainer image
is about 6 GB of which only the top layer changes with the code. This turns the archive into an
OCI image layout streamed to `ctr images import -`: index, manifest and config, plus only the
layer blobs the node's content store does not hold yet (containerd resolves the others from its
store by digest). The archive's members are skipped by seeking, so unchanged layers are not read.

    hack/ctr-import-thin.py --address SOCK --name localhost/ddpjob/trainer:dev ARCHIVE.tar
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tarfile

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def present_digests(ctr: list[str]) -> set[str]:
    out = subprocess.run([*ctr, "content", "ls", "-q"], capture_output=True, text=True, check=True).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _layer_digest(member: str) -> str:
    # containers/image names docker-archive layers "<sha256 hex>.tar" (the digest of the tar itself).
    base = member.rsplit("/", 1)[-1].removesuffix(".tar")
    if len(base) != 64 or any(c not in "0123456789abcdef" for c in base):
        raise SystemExit(f"ctr-import-thin: unexpected layer file name {member!r} (not <sha256>.tar)")
    return f"sha256:{base}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="the node's containerd socket")
    p.add_argument("--namespace", default="k8s.io")
    p.add_argument("--name", required=True, help="image name to record, e.g. localhost/ddpjob/trainer:dev")
    p.add_argument("--all-layers", action="store_true",
                   help="send every layer (the fallback when the node's snapshots do not match its content)")
    p.add_argument("archive")
    args = p.parse_args()
    ctr = ["ctr", "-a", args.address, "-n", args.namespace]

    with tarfile.open(args.archive) as src:
        members = {m.name: m for m in src.getmembers()}
        (entry,) = json.load(src.extractfile(members["manifest.json"]))
        config = src.extractfile(members[entry["Config"]]).read()
        layers = [(name, _layer_digest(name), members[name].size) for name in entry["Layers"]]
        have = set() if args.all_layers else present_digests(ctr)
        manifest = json.dumps({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                       "size": len(config)},
            "layers": [{"mediaType": OCI_LAYER, "digest": d, "size": size} for _, d, size in layers],
        }).encode()
        m_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        index = json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": m_digest, "size": len(manifest),
            "annotations": {"io.containerd.image.name": args.name}}]}).encode()

        proc = subprocess.Popen([*ctr, "images", "import", "-"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        sent = 0
        with tarfile.open(fileobj=proc.stdin, mode="w|") as out:
            _add(out, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
            _add(out, f"blobs/sha256/{m_digest[7:]}", manifest)
            _add(out, f"blobs/sha256/{hashlib.sha256(config).hexdigest()}", config)
            for name, digest, size in layers:
                if digest in have:
                    continue
                info = tarfile.TarInfo(f"blobs/sha256/{digest[7:]}")
                info.size = size
                out.addfile(info, src.extractfile(members[name]))
                sent += size
            _add(out, "index.json", index)
        proc.stdin.close()
        log = proc.stdout.read().decode(errors="replace")
        if proc.wait() != 0:
            print(log, file=sys.stderr)
            return 1
    print(f"{args.name}: sent {sent / 2**20:.0f} MiB of {sum(s for *_, s in layers) / 2**20:.0f} MiB "
          f"({sum(d not in have for _, d, _ in layers)} of {len(layers)} layers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
