"""A real S3 server for the s3:// tests: SeaweedFS (`weed mini`), built once by tests/tools/seaweedfs.sh
and cached outside the repository.  Everything it opens listens on 127.0.0.1 only, telemetry is off,
and its identities file holds the one key pair the tests use.  Workers talk to it with boto3, as real
workers would."""
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import boto3
from botocore.config import Config

ROOT = Path(__file__).resolve().parents[2]
ACCESS_KEY = "AKIADILOCOD0TEST0001"
SECRET_KEY = "dilocod-test-secret-key-0123456789abcdef"
REGION = "us-east-1"


def weed_binary() -> Path:
    """The cached SeaweedFS binary (built on the first call of a fresh machine, ~7 minutes)."""
    p = subprocess.run(["bash", str(ROOT / "tests" / "tools" / "seaweedfs.sh")], capture_output=True, text=True,
                       timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"tests/tools/seaweedfs.sh failed:\n{p.stderr[-4000:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def free_ports(n):
    """n distinct free loopback ports (each one bound at once so none repeats)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class SeaweedS3:
    """weed mini with an S3 gateway on a free loopback port and a bucket; stop() ends it."""

    def __init__(self, tmp: Path, bucket="dilocod-test", host="127.0.0.1"):
        """host: the one address every component binds (tests/bench/netns.py passes its bridge's, so that
        aggregators in their own network namespaces reach the server)."""
        self.tmp = Path(tmp)
        self.bucket = bucket
        self.dir = self.tmp / "seaweedfs"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.tmp / "seaweedfs.log"
        ids = {"identities": [{"name": "dilocod-test",
                               "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                               "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
        self.config_path = self.tmp / "s3-identities.json"
        self.config_path.write_text(json.dumps(ids))
        (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, admin, admin_g,
         debug, s3_debug) = free_ports(12)
        self.port = s3
        self.endpoint = f"http://{host}:{s3}"
        self.cmd = [str(weed_binary()), "mini", f"-dir={self.dir}",
                    f"-ip={host}", f"-ip.bind={host}", "-master.telemetry=false", "-admin.ui=false",
                    "-webdav=false", "-admin.port.legacy=0", "-s3.port.iceberg=0", "-s3.port.lance=0",
                    f"-master.port={master}", f"-master.port.grpc={master_g}",
                    f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
                    f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
                    f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
                    f"-admin.port={admin}", f"-admin.port.grpc={admin_g}",
                    f"-debug.port={debug}", f"-s3.debug.port={s3_debug}",
                    f"-s3.config={self.config_path}"]
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
                                     cwd=self.dir)
        s3 = self.client()
        deadline = time.time() + 120
        last = None
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                s3.create_bucket(Bucket=self.bucket)
                return self
            except Exception as e:      # not up yet: connection refused, 503 while the filer starts
                if "BucketAlreadyExists" in str(e) or "BucketAlreadyOwnedByYou" in str(e):
                    return self
                last = e
                time.sleep(0.25)
        raise RuntimeError(f"SeaweedFS S3 did not come up: {last}\n{self.log_text()[-4000:]}")

    def log_text(self):
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.proc = None

    def client(self, secret=SECRET_KEY):
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=secret, region_name=REGION,
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}))

    def listening(self):
        """(address, port) of every TCP socket the weed process listens on (from ss)."""
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        found = []
        for line in out.splitlines():
            if f"pid={self.proc.pid}," not in line:
                continue
            local = line.split()[3]
            addr, _, port = local.rpartition(":")
            found.append((addr, int(port)))
        return found

    def env(self):
        """What dilocod needs to reach this server with the test credentials."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
