"""The container image: the Dockerfile lints clean, has the shape operators expect, and the steps it
runs work. No Docker engine runs here, so the test reads the Dockerfile and runs its own uv and
python steps in a scratch directory that stands in for the image's filesystem."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

import pytest
from packaging.requirements import Requirement

from tests import fast_conversion

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "docker" / "requirements.txt"
BIN = Path(sys.executable).parent


@dataclass
class Instruction:
    stage: int  # 0 for the first FROM
    keyword: str  # upper case: RUN, COPY, ...
    args: str  # continuation lines joined


def parse(path: Path = DOCKERFILE) -> tuple[dict[str, str], list[Instruction]]:
    """The Dockerfile's global ARG defaults and its instructions, continuation lines joined."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        if raw.strip().startswith("#") or not raw.strip():
            continue  # comments may sit inside a continued instruction too
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        lines.append(current.strip())
        current = ""
    global_args: dict[str, str] = {}
    instructions, stage = [], -1
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        elif stage < 0 and keyword == "ARG":
            name, _, default = args.partition("=")
            global_args[name] = default
            continue
        instructions.append(Instruction(stage, keyword, args.strip()))
    return global_args, instructions


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonical(name)] = version
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_module():
    spec = importlib.util.spec_from_file_location("docker_lock", ROOT / "docker" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hadolint_clean() -> None:
    result = subprocess.run([str(BIN / "hadolint"), str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape() -> None:
    global_args, instructions = parse()
    final = max(i.stage for i in instructions)
    last = {i.keyword: i.args for i in instructions if i.stage == final}  # the last of each keyword
    bases = {Template(i.args.split()[0]).substitute(global_args) for i in instructions if i.keyword == "FROM"}
    cuda = {b for b in bases if b.startswith("nvidia/cuda:")}
    assert len(cuda) == 1 and len(bases) >= 2, bases  # builder and server on one CUDA image
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", cuda.pop())
    assert all(re.search(r":\d+(\.\d+)+", b) for b in bases), "every base pinned by its version tag"
    user = last["USER"].split(":")[0]
    assert user.isdigit() and int(user) != 0, "a numeric non-root user"
    assert last["EXPOSE"] == "8000"
    assert "/health" in last["HEALTHCHECK"]
    assert json.loads(last["ENTRYPOINT"]) == ["minillm", "serve"]
    assert json.loads(last["VOLUME"]) == ["/models"]
    env = " ".join(i.args for i in instructions if i.stage == final and i.keyword == "ENV")
    assert "MINILLM_MODELS_DIR=/models" in env.split()
    assert any(i.keyword == "ARG" and i.args.startswith("BAKE_MODEL=") for i in instructions)


def test_dockerignore_lets_in_exactly_what_is_copied() -> None:
    patterns = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert patterns[0] == "*", "an allowlist: nothing enters the build context unless named"
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    _, instructions = parse()
    copied = {src for i in instructions if i.keyword == "COPY" and not i.args.startswith("--from")
              for src in shlex.split(i.args)[:-1]}
    assert copied == allowed


def test_lock_pins_every_requirement() -> None:
    """docker/requirements.txt pins each of minillm's requirements (and the `convert` extra's) to
    a version the requirement allows, torch as the CUDA build (no +cpu)."""
    pins = lock_pins()
    for text in lock_module().requirements():
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"sys_platform": "linux", "python_version": "3.12"}):
            continue
        assert canonical(req.name) in pins, f"{req.name} is not pinned"
        assert req.specifier.contains(pins[canonical(req.name)], prereleases=True), (text, pins[canonical(req.name)])
    assert "+" not in pins["torch"] and "triton" in pins


class Image:
    """A scratch directory standing in for the image's filesystem: the absolute paths the Dockerfile
    writes (the venv, the workdirs, the models dir, where uv goes) are mapped under it."""

    def __init__(self, root: Path, instructions: list[Instruction]) -> None:
        self.root = root
        root.mkdir(parents=True)
        paths = {i.args for i in instructions if i.keyword == "WORKDIR"}
        for i in instructions:
            if i.keyword == "ENV":
                paths |= {v for v in re.findall(r"=(/[\w/.-]+)", i.args) if not v.endswith("/bin")}
            elif i.keyword == "COPY" and i.args.startswith("--from"):
                paths.add(os.path.dirname(shlex.split(i.args)[-1]))
        self.paths = sorted(paths, key=len, reverse=True)
        # A clean environment (this venv off PATH), keeping this machine's pip and proxy settings.
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("MINILLM_", "VIRTUAL_ENV", "PYTHON", "UV_"))}
        host_path = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != BIN]
        self.env["PATH"] = os.pathsep.join([self.here(p) for p in self.paths if p.endswith("/bin")] + host_path)
        self.cwd = root

    def here(self, text: str) -> str:
        for path in self.paths:
            text = re.sub(rf"(?<![\w/.]){re.escape(path)}(?![\w.-])", str(self.root) + path, text)
        return text

    def apply(self, i: Instruction) -> None:
        """ENV, ARG (build args already in self.env win), WORKDIR, and COPY from the build context;
        `COPY --from=uv` (the uv image's binary) gets this venv's uv."""
        if i.keyword == "ENV":
            for pair in shlex.split(i.args):
                name, _, value = pair.partition("=")
                self.env[name] = self.here(Template(value).safe_substitute(self.env))
        elif i.keyword == "ARG":
            name, _, default = i.args.partition("=")
            self.env.setdefault(name, default)
        elif i.keyword == "WORKDIR":
            self.cwd = Path(self.here(i.args))
            self.cwd.mkdir(parents=True, exist_ok=True)
        elif i.keyword == "COPY" and i.args.startswith("--from=uv "):
            target = Path(self.here(shlex.split(i.args)[-1]))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(BIN / "uv")
        elif i.keyword == "COPY" and not i.args.startswith("--from"):
            *sources, dest = shlex.split(i.args)
            target = self.cwd / self.here(dest)
            for src in sources:
                to = target / Path(src).name if dest.endswith("/") or len(sources) > 1 else target
                to.parent.mkdir(parents=True, exist_ok=True)
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, to, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(ROOT / src, to)

    def run(self, command: str) -> str:
        result = subprocess.run(["/bin/sh", "-c", self.here(command)], cwd=self.cwd, env=self.env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result.stdout + result.stderr


SYSTEM_STEPS = ("apt-get", "useradd")  # need Ubuntu and root; every other RUN runs here


@pytest.mark.slow
def test_install_steps(tmp_path: Path, default_model_dir: Path) -> None:
    """The Dockerfile's own RUN steps, in order, with BAKE_MODEL=1.

    The pinned-dependency step runs with --dry-run for the image's Python and platform: the GBs of
    CUDA wheels would not fit a CPU test, and resolving is what can go wrong (a pin with no CPython
    3.12 wheel, a lock not closed under its dependencies). The bake then runs on the minillm that
    the image's steps installed, over this venv's packages in place of that pinned layer, with the
    session's conversion standing in for its dequantizing (tests/fast_conversion.py)."""
    _, instructions = parse()
    image = Image(tmp_path / "image", instructions)
    image.env["BAKE_MODEL"] = "1"
    skipped, baked = [], False
    for i in instructions:
        if i.keyword != "RUN":
            image.apply(i)
        elif any(step in i.args for step in SYSTEM_STEPS):
            skipped.append(i.args)
        elif "-r docker/requirements.txt" in i.args:
            output = image.run(shlex.join([*shlex.split(i.args), "--dry-run", *lock_module().TARGET_FLAGS]))
            would_install = dict(re.findall(r"^ \+ (\S+)==(\S+)$", output, re.MULTILINE))
            assert {canonical(n): v for n, v in would_install.items()} == lock_pins(), output
        else:
            if "ensure_default_model" in i.args:
                [site] = Path(image.env["VIRTUAL_ENV"]).glob("lib/python*/site-packages")
                # Appended to sys.path, so the image's own minillm still comes first.
                (site / "deps.pth").write_text(_site_packages() + "\n")
                image.env.update(fast_conversion.install(site, default_model_dir))
                baked = True
            image.run(i.args)

    assert len(skipped) == 3, skipped  # apt-get in each stage, useradd in the last
    assert baked, "the bake step ran"
    venv = Path(image.env["VIRTUAL_ENV"])
    probe = subprocess.run(["python", "-c", "import engine; print(engine.__file__)"],
                           cwd=image.cwd, env=image.env, capture_output=True, text=True, check=True)
    assert probe.stdout.startswith(str(venv)), "the bake used the minillm installed in the image's venv"
    model = Path(image.env["MINILLM_MODELS_DIR"]) / "SmolLM2-135M-Instruct"
    assert (model / ".minillm-complete.json").is_file() and (model / "model.safetensors").is_file()


def _site_packages() -> str:
    import torch  # any package of this venv

    return str(Path(torch.__file__).parents[1])
