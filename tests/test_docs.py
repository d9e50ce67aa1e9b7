"""The docs: the site builds strictly, the reference covers the public API, the README stays a front door."""

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hpcddp
import hpcddp.horovod
import hpcddp.testing
from hpcddp.testing import run_mpi

from .conftest import ROOT

DOCS = Path(ROOT) / "docs"
README = Path(ROOT) / "README.md"
REFERENCE = DOCS / "reference"
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# `::: hpcddp.name` lines: the objects mkdocstrings documents.
DIRECTIVE = re.compile(r"^:::\s+(hpcddp(?:\.\w+)*)\s*$", re.MULTILINE)
# A heading mkdocstrings rendered: its id is the object's path, its class says what kind it is.
RENDERED = re.compile(
    r'<h\d id="(hpcddp(?:\.\w+)*)" class="doc doc-heading">\s*<span class="doc doc-object-name doc-(\w+)-name">'
)


def documented_paths() -> list[str]:
    """Every object path the reference pages name in a `:::` line."""
    return [path for page in sorted(REFERENCE.glob("*.md")) for path in DIRECTIVE.findall(page.read_text())]


def resolve(path: str):
    """The object at a dotted path, as `import hpcddp` then attribute access sees it.

    An attribute wins over a submodule of the same name (`hpcddp.device` is the function
    `__init__` imports, not the module `device.py`); a submodule is imported only when the
    package has no attribute of that name.
    """
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def public_api() -> dict[str, object]:
    """Every public name: `hpcddp.__all__`, `hpcddp.horovod.__all__`, `hpcddp.testing.__all__`."""
    return {
        f"{module.__name__}.{name}": getattr(module, name)
        for module in (hpcddp, hpcddp.horovod, hpcddp.testing)
        for name in module.__all__
    }


@pytest.mark.unit
def test_mkdocs_build_is_strict_and_renders_every_public_name(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        if CI:
            pytest.fail("CI must build the docs, but mkdocs is not installed: pip install -e '.[dev]'")
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]'); the docs build is not checked")
    site = tmp_path / "site"
    # NO_MKDOCS_2_WARNING: Material prints a banner about MkDocs 2.0 on every build; it is not a build warning.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{output}"

    rendered = {}
    for page in (site / "reference").rglob("index.html"):
        rendered.update(RENDERED.findall(page.read_text()))
    for path, obj in public_api().items():
        if path == "hpcddp.__version__":
            assert rendered.get(path) == "attribute", path
            continue
        assert path in rendered, f"{path} is public but the API reference does not render it"
        # griffe keeps a submodule over a re-exported function of the same name unless
        # no submodule shares a public name: the page would document the module.
        if not inspect.ismodule(obj):
            assert rendered[path] != "module", f"{path} is rendered as a module, but it is {obj!r}"


@pytest.mark.unit
def test_every_documented_name_imports():
    paths = documented_paths()
    assert paths, f"no `::: hpcddp...` lines in {REFERENCE}"
    for path in paths:
        resolve(path)  # raises AttributeError / ImportError naming the path


@pytest.mark.unit
def test_every_public_name_is_in_the_reference():
    documented = set(documented_paths())
    missing = [f"hpcddp.{name}" for name in hpcddp.__all__ if f"hpcddp.{name}" not in documented]
    assert not missing, f"in hpcddp.__all__ but no `::: ` line in docs/reference/: {missing}"
    assert "hpcddp.horovod" in documented
    for name in ("run_mpi", "run_script", "run_pytest_on_ranks", "assert_pytest_passed"):
        assert f"hpcddp.testing.{name}" in documented


@pytest.mark.unit
def test_every_public_function_and_class_has_a_docstring():
    undocumented = [
        path
        for path, obj in public_api().items()
        if (inspect.isroutine(obj) or inspect.isclass(obj)) and not (obj.__doc__ or "").strip()
    ]
    assert not undocumented, f"public names without a docstring: {undocumented}"


@pytest.mark.unit
def test_readme_is_under_12_kib():
    size = README.stat().st_size
    assert size < 12 * 1024, f"README.md is {size} bytes; move detail into docs/ and link to it"


@pytest.mark.unit
def test_readme_relative_links_point_to_files():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    broken = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the README itself
        if not (Path(ROOT) / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


@pytest.mark.ranks
def test_readme_example_trains_on_two_ranks(tmp_path):
    section = README.read_text().split("## A training script", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    script = tmp_path / "train.py"
    script.write_text(code)
    result = run_mpi(2, [sys.executable, str(script)], timeout=180, cwd=str(tmp_path))
    assert result.returncode == 0, result.stdout[-5000:]
    assert "epoch 4: loss" in result.stdout and "on 2 ranks" in result.stdout, result.stdout[-5000:]


@pytest.mark.ranks
def test_checkpoints_guide_loop_stops_on_every_rank_and_resumes(tmp_path):
    page = (DOCS / "guide" / "checkpoints.md").read_text()
    code = re.search(r"## A preemption-safe loop\n.*?```python\n(.*?)```", page, re.DOTALL).group(1)
    # A stop signal that reaches rank 0 alone, at its 5th step: every rank must stop there.
    stop_on_rank_0 = (
        "import hpcddp\n"
        "_should_stop = hpcddp.PreemptionHandler.should_stop\n"
        "def should_stop(self, calls=[0]):\n"
        "    calls[0] += 1\n"
        "    if calls[0] == 5 and hpcddp.rank() == 0:\n"
        "        self.request()\n"
        "    return _should_stop(self)\n"
        "hpcddp.PreemptionHandler.should_stop = should_stop\n"
    )
    (tmp_path / "stopped.py").write_text(stop_on_rank_0 + code)
    report_resume = (
        "import hpcddp\n"
        "_restore = hpcddp.restore_training_state\n"
        "def restore_training_state(*args, **kwargs):\n"
        "    progress = _restore(*args, **kwargs)\n"
        "    print(f'rank {hpcddp.rank()} resumed at step {progress.step}')\n"
        "    return progress\n"
        "hpcddp.restore_training_state = restore_training_state\n"
    )
    (tmp_path / "resumed.py").write_text(report_resume + code)
    env = {"HPCDDP_CHECKPOINT_DIR": str(tmp_path / "run")}
    first = run_mpi(2, [sys.executable, "stopped.py"], timeout=180, cwd=str(tmp_path), env=env)
    assert first.returncode == 0, first.stdout[-5000:]
    assert "rank 0 at step 5" in first.stdout and "rank 1 at step 5" in first.stdout, first.stdout[-5000:]
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*.pt")) == ["checkpoint-000005.pt"]
    second = run_mpi(2, [sys.executable, "resumed.py"], timeout=180, cwd=str(tmp_path), env=env)
    assert second.returncode == 0, second.stdout[-5000:]
    assert "rank 0 resumed at step 5" in second.stdout and "rank 1 resumed at step 5" in second.stdout
    assert "rank 0 at step 500" in second.stdout and "rank 1 at step 500" in second.stdout, second.stdout[-5000:]
