"""scripts/setup.sh: which torch a machine gets, and one environment for serve.sh and test.sh.

The torch choice (scripts/torch_choice.sh) runs as it does on a user's machine, with a faked
``nvidia-smi`` on PATH (present and reporting a driver's CUDA version, failing, or absent) and
PyTorch's index served by a local HTTP server, refused, silent, or without the pinned build.

setup.sh itself runs in a copy of the set-up's inputs with a stub ``.venv`` whose ``python``
and ``uv`` only record what they are asked to install, and stub ``dpkg``/``npm``: what it
installs, and that the plain and the ``--dev`` set-up never undo each other.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.test_dockerfile import STAGES, effective_env

ROOT = Path(__file__).resolve().parents[2]
TORCH_CHOICE = ROOT / "scripts" / "torch_choice.sh"
SETUP = ROOT / "scripts" / "setup.sh"
BASH = shutil.which("bash") or "/bin/bash"
#: What the scripts run besides bash built-ins and Python (given as PYTHON).
TOOLS = ("cat", "cut", "dirname", "grep", "head", "id", "sha256sum", "timeout")
TORCH = "2.13.0"


def smi_header(cuda: str, driver: str = "580.65.06") -> str:
    """The line of ``nvidia-smi``'s table that carries the driver's CUDA version."""
    return f"| NVIDIA-SMI {driver}    Driver Version: {driver}    CUDA Version: {cuda}     |"


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A PATH holding only the tools the scripts need (no real nvidia-smi of this machine)."""
    directory = tmp_path / "bin"
    directory.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is not installed"
        (directory / tool).symlink_to(found)
    return directory


def fake_tool(bin_dir: Path, name: str, body: str) -> Path:
    path = bin_dir / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)
    return path


def fake_nvidia_smi(bin_dir: Path, output: str, status: int = 0) -> Path:
    """An nvidia-smi that prints OUTPUT and exits with STATUS; it leaves a mark when run."""
    mark = bin_dir.parent / "nvidia-smi-ran"
    return fake_tool(bin_dir, "nvidia-smi", f"touch {mark}\ncat <<'EOF'\n{output}\nEOF\nexit {status}")


@dataclass
class Index:
    """PyTorch's per-build wheel indexes, as a local HTTP server serves them."""

    base: str
    root: Path

    def publish(self, variant: str, *wheels: str) -> None:
        page = self.root / variant / "torch" / "index.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        # The real index names its files with the "+" of the local version quoted.
        links = "".join(f'<a href="/whl/{variant}/{w.replace("+", "%2B")}">{w}</a><br>' for w in wheels)
        page.write_text(f"<html><body>{links}</body></html>")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    root = tmp_path / "www" / "whl"
    root.mkdir(parents=True)
    handler = functools.partial(QuietHandler, directory=str(root.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Index(f"http://127.0.0.1:{server.server_address[1]}/whl", root)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def full_index(index: Index) -> Index:
    """Every build of the pinned torch, as PyTorch's index has them."""
    for variant in ("cpu", "cu126", "cu130"):
        index.publish(variant, f"torch-{TORCH}+{variant}-cp311-cp311-manylinux_2_28_x86_64.whl")
    return index


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@dataclass
class Choice:
    values: dict[str, str]
    lines: list[str]
    returncode: int


def choose(bin_dir: Path, index_base: str, **env: str) -> Choice:
    environ = {
        "PATH": str(bin_dir),
        "PYTHON": sys.executable,
        "PYTORCH_INDEX_BASE": index_base,
        "TORCH_INDEX_TIMEOUT": "5",
        **env,
    }
    done = subprocess.run(
        [BASH, str(TORCH_CHOICE)], env=environ, capture_output=True, text=True, timeout=120, check=False
    )
    values = dict(line.split("=", 1) for line in done.stdout.splitlines())
    return Choice(values, done.stderr.splitlines(), done.returncode)


def test_no_driver_gets_the_cpu_build_from_the_cpu_index(bin_dir: Path, full_index: Index) -> None:
    choice = choose(bin_dir, full_index.base)
    assert choice.returncode == 0, choice.lines
    assert choice.values == {
        "variant": "cpu",
        "torch_spec": f"torch=={TORCH}+cpu",
        "torchaudio_spec": "torchaudio==2.11.*",
        "index": f"{full_index.base}/cpu",
    }
    [line] = choice.lines
    assert "CPU build" in line and "nvidia-smi not found" in line and f"{full_index.base}/cpu" in line


@pytest.mark.parametrize(
    ("cuda", "variant"),
    [
        ("13.0", "cu130"),
        ("13.2", "cu130"),  # newer than every build: the newest (cu132 is only experimental)
        ("14.1", "cu130"),  # a newer major version still runs older builds
        ("12.8", "cu126"),
        ("12.6", "cu126"),
        ("12.2", "cu126"),  # older than 12.6, same major version: minor version compatibility
    ],
)
def test_a_driver_gets_the_cuda_build_it_supports(
    bin_dir: Path, full_index: Index, cuda: str, variant: str
) -> None:
    fake_nvidia_smi(bin_dir, "+-----+\n" + smi_header(cuda) + "\n+-----+")
    choice = choose(bin_dir, full_index.base)
    assert choice.returncode == 0, choice.lines
    assert choice.values["variant"] == variant
    assert choice.values["torch_spec"] == f"torch=={TORCH}+{variant}"
    assert choice.values["index"] == f"{full_index.base}/{variant}"
    # torchaudio from the same index: the same build as torch.
    assert choice.values["torchaudio_spec"] == "torchaudio==2.11.*"
    [line] = choice.lines
    assert f"supports CUDA {cuda}" in line and f"{full_index.base}/{variant}" in line


@pytest.mark.parametrize(
    ("output", "status", "why"),
    [
        (smi_header("11.8", "520.61.05"), 0, "update the driver"),
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", 9, "failed"),
        ("No devices were found", 0, "no CUDA version"),
    ],
)
def test_an_unusable_driver_gets_the_cpu_build(
    bin_dir: Path, full_index: Index, output: str, status: int, why: str
) -> None:
    fake_nvidia_smi(bin_dir, output, status)
    choice = choose(bin_dir, full_index.base)
    assert (choice.values["variant"], choice.values["torch_spec"]) == ("cpu", f"torch=={TORCH}+cpu")
    [line] = choice.lines
    assert why in line


def assert_fell_back(choice: Choice, reason: str) -> None:
    assert choice.returncode == 0, choice.lines
    assert choice.values["torch_spec"] == f"torch=={TORCH}"
    assert choice.values["index"] == ""  # pip's configured sources
    [line] = choice.lines  # said in one line
    assert "falling back to what pip finds" in line and reason in line, line


def test_an_unreachable_index_falls_back_to_what_pip_finds(bin_dir: Path) -> None:
    choice = choose(bin_dir, f"http://127.0.0.1:{closed_port()}/whl")
    assert_fell_back(choice, "cannot be reached")
    assert choice.values["variant"] == "cpu"


def test_an_index_that_does_not_answer_falls_back_after_the_short_timeout(bin_dir: Path) -> None:
    # The kernel completes the connection; nothing ever answers (a firewall that drops).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        choice = choose(bin_dir, f"http://127.0.0.1:{port}/whl", TORCH_INDEX_TIMEOUT="1")
    assert_fell_back(choice, "cannot be reached within 1 s")


def test_an_index_without_the_pinned_build_falls_back(bin_dir: Path, index: Index) -> None:
    # A mirror, or a proxy's page, that answers but lacks torch 2.13.0+cu130.
    index.publish("cu130", "torch-2.12.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl")
    fake_nvidia_smi(bin_dir, smi_header("13.0"))
    choice = choose(bin_dir, index.base)
    assert_fell_back(choice, f"lists no torch-{TORCH}+cu130-* wheel")
    assert choice.values["variant"] == "cu130"


def test_torch_spec_overrides_without_detection_or_probe(bin_dir: Path, tmp_path: Path) -> None:
    fake_nvidia_smi(bin_dir, smi_header("13.0"))
    dead = f"http://127.0.0.1:{closed_port()}/whl"
    choice = choose(bin_dir, dead, TORCH_SPEC="torch==2.13.0+cu126", TORCH_INDEX=f"{dead}/cu126")
    assert choice.returncode == 0, choice.lines
    assert choice.values == {
        "variant": "override",
        "torch_spec": "torch==2.13.0+cu126",
        "torchaudio_spec": "torchaudio==2.11.*",
        "index": f"{dead}/cu126",
    }
    assert not (tmp_path / "nvidia-smi-ran").exists()
    [line] = choice.lines
    assert "as TORCH_SPEC says" in line


def test_torch_variant_skips_the_driver_detection(bin_dir: Path, full_index: Index, tmp_path: Path) -> None:
    fake_nvidia_smi(bin_dir, smi_header("12.8"))
    choice = choose(bin_dir, full_index.base, TORCH_VARIANT="cu130")
    assert (choice.values["torch_spec"], choice.values["index"]) == (
        f"torch=={TORCH}+cu130",
        f"{full_index.base}/cu130",
    )
    assert not (tmp_path / "nvidia-smi-ran").exists()


def test_an_unknown_torch_variant_is_refused(bin_dir: Path, full_index: Index) -> None:
    choice = choose(bin_dir, full_index.base, TORCH_VARIANT="cu118")
    assert choice.returncode != 0
    [line] = choice.lines
    assert "TORCH_VARIANT=cu118" in line and "cpu cu130 cu126" in line


@pytest.mark.parametrize(
    ("image", "smi"),
    [("cpu", None), ("gpu", smi_header("13.0"))],
    ids=["cpu-without-a-driver", "gpu-with-a-cuda-13-driver"],
)
def test_the_images_install_what_the_setup_picks(
    bin_dir: Path, full_index: Index, image: str, smi: str | None
) -> None:
    """The Dockerfile names its torch instead of detecting it (the machine that builds an image
    is not the one that runs it): the same torch, from the same index, that the set-up picks on
    a machine without a driver (cpu) and on one whose driver the GPU image requires (gpu)."""
    if smi:
        fake_nvidia_smi(bin_dir, smi)
        required = effective_env(image)["NVIDIA_REQUIRE_CUDA"]
        assert required == f"cuda>={smi.split('CUDA Version:')[1].split()[0]}", "a driver the image accepts"
    choice = choose(bin_dir, full_index.base)
    assert choice.returncode == 0, choice.lines
    args = STAGES[f"{image}-build"].args()
    default_base = re.search(
        r'PYTORCH_INDEX_BASE="\$\{PYTORCH_INDEX_BASE:-([^}]+)\}"', TORCH_CHOICE.read_text()
    )
    assert default_base, "torch_choice.sh has no default PYTORCH_INDEX_BASE"
    assert choice.values["torch_spec"] == args["TORCH_SPEC"] == STAGES[image].args()["TORCH_SPEC"]
    assert choice.values["index"].replace(full_index.base, default_base.group(1)) == args["TORCH_INDEX_URL"]


# --- setup.sh with a stub .venv ------------------------------------------------------------

STUB_PYTHON = """\
echo "python $*" >> "$(dirname "$0")/../calls"
if [[ "$*" == "-m pip config list" ]]; then
  # As pip prints it: sorted, PIP_* variables as ":env:" (which win over the files).
  echo ":env:.constraint='/srv/constraints.txt'"
  echo ":env:.find-links='/srv/wheels'"
  echo "global.extra-index-url='file:///srv/a/simple file:///srv/b/simple'"
  echo "global.find-links='/srv/old-wheels'"
fi
[[ "${1:-}" == - ]] && cat >/dev/null  # torch_check's script on stdin
exit 0
"""


@dataclass
class Checkout:
    """A copy of what setup.sh reads, with a stub .venv that records each install."""

    root: Path
    bin_dir: Path
    index_base: str

    def setup(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": str(self.bin_dir), "PYTHON": sys.executable, "PYTORCH_INDEX_BASE": self.index_base}
        return subprocess.run(
            [BASH, str(self.root / "scripts" / "setup.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def installs(self) -> list[str]:
        """The uv installs so far (one string per call), and forgets them."""
        calls = self.root / ".venv" / "calls"
        lines = calls.read_text().splitlines() if calls.exists() else []
        calls.unlink(missing_ok=True)
        return [line.removeprefix("uv pip install ") for line in lines if line.startswith("uv pip install")]


@pytest.fixture
def checkout(tmp_path: Path, bin_dir: Path, full_index: Index) -> Checkout:
    root = tmp_path / "repo"
    for name in ("scripts/setup.sh", "scripts/torch_choice.sh", "pyproject.toml", "client_py/pyproject.toml"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, root / name)
    (root / "client_js" / "node_modules").mkdir(parents=True)
    (root / "client_js" / "package-lock.json").write_text("{}")
    venv_bin = root / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    fake_tool(venv_bin, "python", STUB_PYTHON)
    fake_tool(venv_bin, "uv", 'echo "uv $*" >> "$(dirname "$0")/../calls"')
    fake_tool(bin_dir, "dpkg", "exit 0")  # every system package is there
    fake_tool(bin_dir, "node", "exit 0")
    fake_tool(bin_dir, "npm", "exit 0")
    return Checkout(root, bin_dir, full_index.base)


def test_setup_installs_the_chosen_torch_with_pips_sources(checkout: Checkout) -> None:
    done = checkout.setup()
    assert done.returncode == 0, done.stderr
    torch_step, packages = checkout.installs()
    index = f"{checkout.index_base}/cpu"
    sources = (
        "--extra-index-url file:///srv/a/simple --extra-index-url file:///srv/b/simple"
        " --find-links /srv/wheels --constraint /srv/constraints.txt"
    )
    assert sources in torch_step and sources in packages  # uv gets what pip.conf tells pip
    assert "/srv/old-wheels" not in torch_step + packages
    assert torch_step.endswith(f"--index-url {index} torch=={TORCH}+cpu torchaudio==2.11.*")
    # The plain set-up has the client too (python -m bench imports it), without the dev extras.
    assert packages.endswith("-e .[model] -e ./client_py")
    assert f"torch=={TORCH}+cpu" in done.stderr and "ready: .venv (base)" in done.stderr


def test_setup_with_the_index_unreachable_falls_back_in_one_line(checkout: Checkout) -> None:
    checkout.index_base = f"http://127.0.0.1:{closed_port()}/whl"
    done = checkout.setup()
    assert done.returncode == 0, done.stderr
    torch_step, _ = checkout.installs()
    assert "--index-url" not in torch_step and torch_step.endswith(f"torch=={TORCH} torchaudio==2.11.*")
    fallback = [line for line in done.stderr.splitlines() if "falling back" in line]
    assert len(fallback) == 1 and "cannot be reached" in fallback[0]


def test_plain_and_dev_setups_share_one_environment(checkout: Checkout) -> None:
    assert checkout.setup().returncode == 0
    assert checkout.installs()[-1].endswith("-e .[model] -e ./client_py")
    assert checkout.setup().returncode == 0
    assert checkout.installs() == []  # nothing changed: nothing to do

    assert checkout.setup("--dev").returncode == 0
    assert checkout.installs()[-1].endswith("-e .[model,dev] -e ./client_py[pipecat,livekit]")
    # dev is a superset: switching back and forth installs nothing (serve.sh, test.sh, serve.sh).
    for args in ((), ("--dev",), ()):
        done = checkout.setup(*args)
        assert done.returncode == 0, done.stderr
        assert checkout.installs() == [], args
    assert "up to date (dev)" in checkout.setup("--plan").stderr

    # A changed input reinstalls; a plain run then keeps the dev packages.
    with (checkout.root / "pyproject.toml").open("a") as f:
        f.write("\n# changed\n")
    assert "install the dev Python packages" in checkout.setup("--plan").stderr
    assert checkout.installs() == []  # --plan changes nothing
    assert checkout.setup().returncode == 0
    assert checkout.installs()[-1].endswith("-e .[model,dev] -e ./client_py[pipecat,livekit]")
    assert checkout.setup("--dev").returncode == 0
    assert checkout.installs() == []


def test_a_new_driver_reinstalls_torch(checkout: Checkout) -> None:
    assert checkout.setup().returncode == 0
    checkout.installs()
    fake_nvidia_smi(checkout.bin_dir, smi_header("13.0"))
    done = checkout.setup()
    assert done.returncode == 0, done.stderr
    torch_step, _ = checkout.installs()
    assert torch_step.endswith(
        f"--index-url {checkout.index_base}/cu130 torch=={TORCH}+cu130 torchaudio==2.11.*"
    )


def test_setup_refuses_an_unknown_argument(checkout: Checkout) -> None:
    done = checkout.setup("--devv")
    assert done.returncode == 2 and "usage" in done.stderr
    assert os.listdir(checkout.root / ".venv") == ["bin"]  # nothing was installed or stamped


# --- python -m bench after the plain set-up ---------------------------------------------------

BENCH_HELP_IMPORTS = """\
import json, runpy, sys
sys.argv = ["bench", "--help"]
try:
    runpy.run_module("bench", run_name="__main__", alter_sys=True)
except SystemExit as e:
    status = e.code
print(json.dumps({"status": status, "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def requirement_closure(roots: list[tuple[str, set[str]]]) -> set[str]:
    """The installed distributions that ROOTS (name, extras) need, transitively, by their metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not extras:
            continue
        seen.add(key)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in extras or {""}):
                todo.append((requirement.name, set(requirement.extras)))
    return seen


def test_python_m_bench_help_needs_only_what_the_plain_setup_installs() -> None:
    """The plain set-up installs chattts-stream[model] and the client: enough for the bench's --help."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    done = subprocess.run(
        [sys.executable, "-c", BENCH_HELP_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["status"] == 0
    plain = requirement_closure([("chattts-stream", {"model"}), ("chattts-stream-client", set())])
    owners = metadata.packages_distributions()
    ours = {"bench", "server", "tests"}
    needed = {
        canonicalize_name(dist)
        for module in report["modules"]
        if module not in sys.stdlib_module_names and module not in ours
        for dist in owners.get(module, [])
    }
    assert "chattts-stream-client" in needed  # the import that used to fail
    assert needed <= plain, (
        f"python -m bench --help imports packages only the dev set-up has: {needed - plain}"
    )


# --- torch_check: torch and torchaudio import together ------------------------------------

#: A stand-in for torchaudio: like the real one, its import fails while a compiled extension
#: that cannot load lies in lib/ (the CUDA build's, beside a CPU torch).
FAKE_TORCHAUDIO = """\
import pathlib
from .version import __version__
if any((pathlib.Path(__file__).parent / "lib").glob("*.so")):
    raise OSError("libc10_cuda.so: cannot open shared object file: No such file or directory")
"""


def fake_torchaudio(tmp_path: Path, version: str, extension: bool) -> Path:
    package = tmp_path / "site" / "torchaudio"
    (package / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TORCHAUDIO)
    (package / "version.py").write_text(f"__version__ = '{version}'\n")
    if extension:
        (package / "lib" / "_torchaudio.so").write_bytes(b"\x7fELF")
    return package


def torch_check(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    return subprocess.run(
        [BASH, "-c", f'source "{TORCH_CHOICE}" && torch_check "$0"', sys.executable],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def cpu_torch() -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda:
        pytest.skip("torch here is a CUDA build")


@pytest.mark.usefixtures("cpu_torch")
def test_pypis_cuda_torchaudio_beside_a_cpu_torch_loses_only_its_extension(tmp_path: Path) -> None:
    package = fake_torchaudio(tmp_path, "2.11.1+cu132", extension=True)
    done = torch_check(tmp_path)
    assert done.returncode == 0, done.stderr
    assert not list((package / "lib").glob("*.so"))
    [line] = done.stderr.splitlines()
    assert "torchaudio 2.11.1+cu132 without its CUDA extension" in line and "(CPU)" in line
    # Once more (a later set-up): nothing to remove, and the line still says what it is.
    done = torch_check(tmp_path)
    assert done.returncode == 0 and "without its CUDA extension" in done.stderr


@pytest.mark.usefixtures("cpu_torch")
def test_a_torchaudio_of_the_same_build_is_left_whole(tmp_path: Path) -> None:
    # PyTorch's CPU torchaudio: its extension loads (this stand-in imports with it there).
    package = fake_torchaudio(tmp_path, "2.11.1+cpu", extension=True)
    (package / "__init__.py").write_text("from .version import __version__\n")
    done = torch_check(tmp_path)
    assert done.returncode == 0, done.stderr
    assert (package / "lib" / "_torchaudio.so").exists()
    [line] = done.stderr.splitlines()
    assert line.endswith("torchaudio 2.11.1+cpu")


@pytest.mark.usefixtures("cpu_torch")
def test_any_other_import_failure_stops_the_setup(tmp_path: Path) -> None:
    # A CPU torchaudio whose extension does not load is broken, not mismatched: nothing is removed.
    package = fake_torchaudio(tmp_path, "2.11.1+cpu", extension=True)
    done = torch_check(tmp_path)
    assert done.returncode != 0
    assert "torchaudio does not import" in done.stderr and "libc10_cuda.so" in done.stderr
    assert (package / "lib" / "_torchaudio.so").exists()
