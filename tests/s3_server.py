"""A real S3 server on a free loopback port, for the checkpoint tests and benchmarks (moto's, in a
process of its own), and the AWS settings pyarrow's S3 client then needs.

Checkpoints reach it through pyarrow exactly as they would a cloud bucket: multipart uploads,
listings, copies for moves. moto 5.2.2 or later (5.2.1 answers pyarrow's CompleteMultipartUpload
with the wrong XML root, which pyarrow takes for an error).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

#: marks the server process's command line (conftest lets a module's server outlive a test)
MARK = "# litz-test-s3-server"
_SERVER = MARK + """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""
#: what every process of a job reads (from the environment, never from the URI)
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "litz-test", "AWS_SECRET_ACCESS_KEY": "litz-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
MIN_MOTO = (5, 2, 2)


def unusable() -> str | None:
    """Why no S3 server can be started here (moto missing or too old), or None."""
    try:
        import moto
    except ImportError:
        return "the S3 tests need moto's server (pip install -e '.[test]')"
    if tuple(int(p) for p in moto.__version__.split(".")[:3] if p.isdigit()) < MIN_MOTO:
        return f"moto {moto.__version__} answers pyarrow's CompleteMultipartUpload wrongly; 5.2.2 fixed it"
    return None


@contextlib.contextmanager
def s3_bucket(name: str = "litz-test") -> Iterator[str]:
    """Start the server, set the credentials in this process's environment (the job's processes
    inherit them), make bucket ``name``; yield ``s3://NAME?endpoint_override=...&scheme=http``.
    Everything is undone on the way out."""
    import pyarrow.fs as pafs

    old = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err)
        try:
            line = proc.stdout.readline().strip() if proc.stdout else b""
            if not line.isdigit():
                err.seek(0)
                raise RuntimeError(f"the S3 server did not start: {err.read()[-2000:].decode(errors='replace')}")
            uri = f"s3://{name}?endpoint_override=127.0.0.1:{int(line)}&scheme=http"
            fs, bucket = pafs.FileSystem.from_uri(uri + "&allow_bucket_creation=true")
            fs.create_dir(bucket)
            yield uri
        finally:
            if proc.stdin:
                proc.stdin.close()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def location(bucket_uri: str, name: str) -> str:
    """A checkpoint root ``name`` in the bucket of :func:`s3_bucket` (its query string kept)."""
    base, query = bucket_uri.split("?", 1)
    return f"{base}/{name}?{query}"
