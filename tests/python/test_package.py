"""The wheel installs and imports: the module is the installed one, its version the engine's."""

import re
import sys

import moeinfer
from moeinfer import _core

from conftest import REPO, run_module


def test_imports_the_installed_module_not_the_source_tree():
    import pathlib
    package = pathlib.Path(moeinfer.__file__).resolve().parent
    assert package != REPO / "python" / "moeinfer"
    assert package.parent.name in ("site-packages", "dist-packages")
    assert pathlib.Path(_core.__file__).resolve().parent == package


def test_version_is_the_engines():
    header = (REPO / "src" / "core" / "version.h").read_text()
    assert moeinfer.__version__ == re.search(r'kVersion = "([^"]+)"', header).group(1)
    out = run_module("--version").stdout
    assert out.strip() == f"moeinfer {moeinfer.__version__}"


def test_public_names():
    for name in moeinfer.__all__:
        assert hasattr(moeinfer, name), name
    assert isinstance(moeinfer.built_with_cuda, bool)
    assert issubclass(moeinfer.UsageError, moeinfer.EngineError)
    assert issubclass(moeinfer.EngineError, RuntimeError)


def test_type_stubs_are_installed():
    import pathlib
    package = pathlib.Path(moeinfer.__file__).parent
    assert (package / "py.typed").is_file()
    stub = (package / "_core.pyi").read_text()
    for name in ("class Engine", "def score", "def generate", "def main", "def plan"):
        assert name in stub, name
    assert sys.version_info >= (3, 9)
